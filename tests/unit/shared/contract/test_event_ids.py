import os
import re

from rollstream.shared.contract.event_ids import new_event_id


def test_event_ids_are_32_hex_digits_unique_in_a_process_and_in_a_child_it_forks():
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child's first id would be the parent's next one, had the child kept its prefix
        os.write(write, new_event_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    os.close(write)
    from_child = os.read(read, 64).decode()
    os.close(read)
    ids = [new_event_id() for _ in range(1000)] + [from_child]
    assert all(re.fullmatch(r"[0-9a-f]{32}", event_id) for event_id in ids)
    assert len(set(ids)) == len(ids)
