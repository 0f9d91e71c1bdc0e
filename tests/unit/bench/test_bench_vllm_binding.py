"""bench/bench_vllm_binding.py in its smoke mode (one server each way, a few tokens): it ends, its same-core
way binds the server where it says and its leased way binds it to the core the lease gave, and it writes
the start and tokens/s figures against the same core, with the load average beside them.

    python -m pytest tests/unit/bench/test_bench_vllm_binding.py -q
"""

from __future__ import annotations

import re

from rollstream.cli.cpu_cores import allowed_cores
from tests.unit.bench.smoke import run_smoke


def test_the_binding_benchmark_measures_the_leased_cores_against_one_core(tiny_model, tmp_path):
    done = run_smoke("bench_vllm_binding.py", tmp_path, "--model", str(tiny_model))
    same = f"all on core {allowed_cores()[0]}"
    assert [f["unit"] for f in done.figures] == ["s", "tokens/s"]
    assert [f["baseline_what"] for f in done.figures] == [f"{same} (vLLM's automatic binding)", same]
    assert [f["what"].split(":")[0] for f in done.figures] == ["leased cores", "leased cores"]
    bound = re.findall(r"^  cores \[(.+?)\], healthy after", done.output, re.M)
    assert bound[0] == f"'{allowed_cores()[0]}'"  # the same-core way's binding, set by its environment
    assert re.fullmatch(r"\(\d+,\)", bound[1])  # a lease's core
    assert done.notes[0].startswith("load average before ") and "other work on the machine" in done.notes[0]
