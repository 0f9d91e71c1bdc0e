"""Wire encoding of a trajectory segment: packed arrays in msgpack (what rollstream.shared.contract.events does) against
the same event as JSON with plain lists. Prints size and encode/decode time, and the ratios.

    python bench/bench_encoding.py [--tokens 2048] [--repeat 2000] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

from results import Figure, parse_args, write_result

from rollstream.shared.contract.events import Envelope, TrajectorySegment, decode, encode, make_envelope


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
    segment = TrajectorySegment(segment_index=0, tokens=[(i * 7919) % 151_000 for i in range(n)], response_length=n // 2,
                                loss_mask=[0] * (n // 2) + [1] * (n - n // 2),
                                rollout_logprobs=[-0.123456 * (i % 17) for i in range(n)], turn_policy_versions=[3],
                                status="completed", response_text="x" * 200, sample_index=1, group_size=8)
    envelope = make_envelope(segment, run_id="bench", rollout_id="r", group_id="g")

    packed = encode(envelope)
    as_json = envelope.model_dump_json().encode()

    def decode_json() -> Envelope:
        body = json.loads(as_json)
        return Envelope.model_validate({**body, "payload": TrajectorySegment.model_validate(body["payload"])})

    assert decode(packed).payload.tokens == decode_json().payload.tokens
    rows = [
        ("packed msgpack", len(packed["body"]), timed(lambda: encode(envelope), args.repeat),
         timed(lambda: decode(packed), args.repeat)),
        ("json lists", len(as_json), timed(envelope.model_dump_json, args.repeat), timed(decode_json, args.repeat)),
    ]
    print(f"segment of {n} tokens, {args.repeat} repeats")
    print(f"{'encoding':<16}{'bytes':>10}{'encode us':>12}{'decode us':>12}")
    for name, size, enc, dec in rows:
        print(f"{name:<16}{size:>10}{enc * 1e6:>12.1f}{dec * 1e6:>12.1f}")
    (_, ps, pe, pd), (_, js, je, jd) = rows
    print(f"ratio json/packed: size {js / ps:.2f}x, encode {je / pe:.2f}x, decode {jd / pd:.2f}x")
    what = f"segment of {n} tokens, packed msgpack"
    write_result(args.json, [Figure(f"{what}: size", ps, "json lists", js, "bytes"),
                             Figure(f"{what}: encode", pe * 1e6, "json lists", je * 1e6, "us"),
                             Figure(f"{what}: decode", pd * 1e6, "json lists", jd * 1e6, "us")])


if __name__ == "__main__":
    main()
