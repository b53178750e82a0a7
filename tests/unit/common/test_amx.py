"""``kv_connector.common.amx``: the AMX permission a vLLM process on CPU asks for first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kv_connector.common.amx import AmxPermission, amx_permitted, cpu_has_amx, request_amx

REPO = Path(__file__).resolve().parents[3]

SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n"


def test_the_cpu_flags_say_whether_there_is_amx() -> None:
    assert cpu_has_amx(SAPPHIRE)
    assert not cpu_has_amx(EPYC)
    assert not cpu_has_amx("")
    assert not cpu_has_amx("model name\t: amx_tile in a name, not a flag\n")


def fresh(code: str) -> dict[str, object]:
    """``code`` in a new Python (a process that has asked for nothing yet); its JSON line."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_a_request_leaves_the_process_permitted_exactly_where_the_cpu_has_amx() -> None:
    got = fresh(
        "import json; from kv_connector.common.amx import *; "
        "before = amx_permitted(); r = request_amx(); "
        "print(json.dumps({'before': before, 'result': r.value, 'after': amx_permitted(), "
        "'again': request_amx().value}))"
    )
    if cpu_has_amx():
        assert got == {"before": False, "result": "granted", "after": True, "again": "granted"}
    else:
        assert got == {"before": False, "result": "no AMX", "after": False, "again": "no AMX"}


def test_it_can_be_turned_off() -> None:
    code = "from kv_connector.common.amx import *; print(request_amx().value, amx_permitted())"
    got = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=True,
        env={"PATH": "/usr/bin:/bin", "KV_CONNECTOR_REQUEST_AMX": "0"},
    )  # fmt: skip
    assert got.stdout.split() == ["no", "AMX", "False"]


def test_in_this_process_the_answer_agrees_with_the_cpu() -> None:
    result = request_amx()
    assert (result is AmxPermission.GRANTED) == cpu_has_amx()
    assert amx_permitted() == cpu_has_amx()
