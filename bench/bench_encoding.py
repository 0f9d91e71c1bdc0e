"""Wire encoding of a trajectory segment: packed arrays in msgpack (rollstream.shared.contract.events's way)
against the same event as JSON with plain lists, each from a producer's lists to a reader's. Prints the size,
the time to make the event from lists and encode it, to decode it (the packed arrays are left packed until
read: PackedArray), and to decode it and read its three arrays as lists; and the ratios.

    python bench/bench_encoding.py [--tokens 2048] [--repeat 2000] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import msgspec
import pydantic_core
from results import Figure, parse_args, write_result

from rollstream.shared.contract.event_structs import validated_model
from rollstream.shared.contract.events import Envelope, TrajectorySegment, decode, encode_event, make_envelope


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parse_args(parser, smoke={"tokens": 256, "repeat": 20})
    n = args.tokens
    # What a producer has: lists. Both ways start from them and end in a reader's lists.
    fields = {"segment_index": 0, "tokens": [(i * 7919) % 151_000 for i in range(n)],
              "response_length": n // 2, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2),
              "rollout_logprobs": [-0.123456 * (i % 17) for i in range(n)], "turn_policy_versions": [3],
              "status": "completed", "response_text": "x" * 200, "sample_index": 1, "group_size": 8}
    ids = {"run_id": "bench", "rollout_id": "r", "group_id": "g"}
    head = make_envelope(TrajectorySegment(**fields), **ids).to_json()

    def encode_packed() -> dict:
        return encode_event(TrajectorySegment(**fields), **ids)

    def encode_json() -> bytes:  # unchecked: the lists go out as they are, by pydantic's Rust encoder
        return pydantic_core.to_json({**head, "payload": fields})

    # The envelope's fields checked by msgspec as the JSON is parsed, the payload's lists by its model
    json_decoder = msgspec.json.Decoder(Envelope[TrajectorySegment], dec_hook=validated_model)

    packed, as_json = encode_packed(), encode_json()

    def decode_json() -> Envelope:
        return json_decoder.decode(as_json)

    def as_lists(envelope: Envelope) -> tuple[list, ...]:
        segment = envelope.payload
        return segment.tokens.tolist(), segment.loss_mask.tolist(), segment.rollout_logprobs.tolist()

    assert as_lists(decode(packed))[0] == as_lists(decode_json())[0] == fields["tokens"]
    rows = [
        ("packed msgpack", len(packed["body"]), timed(encode_packed, args.repeat),
         timed(lambda: decode(packed), args.repeat), timed(lambda: as_lists(decode(packed)), args.repeat)),
        ("json lists", len(as_json), timed(encode_json, args.repeat), timed(decode_json, args.repeat),
         timed(lambda: as_lists(decode_json()), args.repeat)),
    ]
    print(f"segment of {n} tokens, {args.repeat} repeats")
    print(f"{'encoding':<16}{'bytes':>10}{'encode us':>12}{'decode us':>12}{'+ as lists us':>16}")
    for name, size, enc, dec, read in rows:
        print(f"{name:<16}{size:>10}{enc * 1e6:>12.1f}{dec * 1e6:>12.1f}{read * 1e6:>16.1f}")
    (_, ps, pe, pd, pr), (_, js, je, jd, jr) = rows
    print(f"ratio json/packed: size {js / ps:.2f}x, encode {je / pe:.2f}x, decode {jd / pd:.2f}x, "
          f"decode and read as lists {jr / pr:.2f}x")
    what = f"segment of {n} tokens, packed msgpack"
    write_result(args.json, [
        Figure(f"{what}: size", ps, "json lists", js, "bytes"),
        Figure(f"{what}: make from lists and encode", pe * 1e6, "json lists", je * 1e6, "us"),
        Figure(f"{what}: decode (arrays left packed)", pd * 1e6, "json lists", jd * 1e6, "us"),
        Figure(f"{what}: decode and read the arrays as lists", pr * 1e6, "json lists", jr * 1e6, "us"),
    ])


if __name__ == "__main__":
    main()
