"""``autopart schedule``: in-process through main(argv), and as ``python -m autopart`` / ``autopart``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autopart.cli import main

JSON_KEYS = [
    "name", "pp", "microbatches", "virtual_stages", "ranks",
    "forward_cost", "backward_cost", "makespan", "ideal", "bubble", "peak_in_flight",
    # added with the zero-bubble schedules, after the original keys
    "input_grad_cost", "weight_grad_cost", "chunk_ranks", "peak_awaiting_weight_grad",
]  # fmt: skip


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_output(capsys):
    code, out, err = run_main(capsys, "schedule", "--pp", "4", "--microbatches", "8", "--virtual-stages", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "interleaved-1f1b: pp=4, microbatches=8, virtual_stages=2 (chunk k on rank k % 4)"
    assert lines[2] == "rank 0   | rank 1   | rank 2   | rank 3"
    assert lines[4].split(" | ") == ["0F0     ", "1RECV_F0", "2RECV_F0", "3RECV_F0"]
    # Unit chunk costs: ideal 2 chunks x 8 microbatches x (1 + 2) = 48, bubble (4-1)/(2*8).
    assert "makespan        57 (ideal 48; forward 1, backward 2 per chunk)" in out
    assert "bubble          0.1875 = (makespan - ideal) / ideal" in out
    assert "peak in flight  rank 0: 11, rank 1: 9, rank 2: 7, rank 3: 5 (microbatch-chunks)" in out
    assert "= 5.5, 4.5, 3.5, 2.5 full stages of activations" in out


def test_json_output(capsys):
    code, out, _ = run_main(capsys, "schedule", "--pp", "2", "--microbatches", "3", "--json")
    assert code == 0
    report = json.loads(out)
    assert list(report) == JSON_KEYS
    assert report["name"] == "1f1b" and report["virtual_stages"] == 1
    assert report["ranks"][1] == "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2".split()
    assert report["bubble"] == pytest.approx(1 / 3)
    assert report["makespan"] == 12.0
    assert report["peak_in_flight"] == [2, 1]


def test_schedule_and_costs_flags(capsys):
    code, out, _ = run_main(
        capsys, "schedule", "--pp", "2", "--microbatches", "2", "--schedule", "gpipe",
        "--forward-cost", "1", "--backward-cost", "1", "--json",
    )  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["name"] == "gpipe"
    assert report["makespan"] == 6.0 and report["peak_in_flight"] == [2, 2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "4", "--microbatches", "6", "--virtual-stages", "2"],
         "autopart schedule: error: interleaved-1f1b needs microbatches divisible by pp=4 "
         "(it runs them in groups of pp), got 6; nearest valid: 4 or 8"),
        (["--pp", "4", "--microbatches", "8", "--virtual-stages", "2", "--schedule", "1f1b"],
         "autopart schedule: error: 1f1b runs one model chunk per rank (virtual_stages=1), got virtual_stages=2; "
         "use 'interleaved-1f1b' for several chunks per rank"),
        (["--pp", "0", "--microbatches", "8"], "autopart schedule: error: pp must be >= 1, got 0"),
        (["--pp", "2", "--microbatches", "2", "--forward-cost", "-1"],
         "autopart schedule: error: forward cost of chunk 0 must be finite and >= 0, got -1.000000"),
    ],
)  # fmt: skip
def test_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_main(capsys, "schedule", *argv)
    assert code == 2 and out == ""
    assert err == message + "\n"


def test_zero_bubble_text_output(capsys):
    code, out, err = run_main(capsys, "schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-v",
                              "--virtual-stages", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "zb-v: pp=4, microbatches=8, virtual_stages=2 (chunk k on rank k for k < 4, else 7 - k)"
    # F = I = W = 1: ideal 2 chunks x 8 microbatches x 3; bubble max(p-1, 4p-2-2m) = 3
    assert "makespan        51 (ideal 48; forward 1, input-grad 1, weight-grad 1 per chunk)" in out
    assert "bubble          0.0625 = (makespan - ideal) / ideal" in out
    assert "peak in flight  rank 0: 8, rank 1: 8, rank 2: 8, rank 3: 8 (microbatch-chunks)" in out
    assert "awaiting W      rank 0: 1, " in out


def test_zero_bubble_json_and_split_costs(capsys):
    code, out, _ = run_main(capsys, "schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1",
                            "--input-grad-cost", "1", "--weight-grad-cost", "2", "--json")
    report = json.loads(out)
    assert code == 0 and list(report) == JSON_KEYS
    assert (report["backward_cost"], report["input_grad_cost"], report["weight_grad_cost"]) == (3.0, 1.0, 2.0)
    assert report["ideal"] == 4 * (1 + 1 + 2) and report["chunk_ranks"] == [0, 1]
    assert any(token == "1W0" for token in report["ranks"][1])


def test_dualpipe_v_json_bubble(capsys):
    code, out, _ = run_main(capsys, "schedule", "--pp", "3", "--microbatches", "6", "--schedule", "dualpipe-v",
                            "--virtual-stages", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["chunk_ranks"] == [0, 1, 2, 2, 1, 0]
    assert report["makespan"] - report["ideal"] == 2 * (3 - 1)  # DeepSeek-V3's (p-1)(F&B + B - 3W)


def test_png_output(capsys, tmp_path):
    png = tmp_path / "zb.png"
    code, out, _ = run_main(capsys, "schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1",
                            "--png", str(png))
    assert code == 0 and "bubble" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "4", "--microbatches", "8", "--schedule", "zb-v"],
         "autopart schedule: error: zb-v places two chunks per rank in a V (virtual_stages=2), got "
         "virtual_stages=1; use 'zb-h1' for one chunk or several in a loop"),
        (["--pp", "2", "--microbatches", "2", "--schedule", "zb-h1", "--input-grad-cost", "3"],
         "autopart schedule: error: input_grad_cost 3.0 exceeds backward_cost 2.0 (B = I + W); "
         "give both input_grad_cost and weight_grad_cost"),
        (["--pp", "512", "--microbatches", "4096"],
         "autopart schedule: error: 1f1b with pp=512, microbatches=4096, virtual_stages=1 has about 12 million "
         "actions, more than the 5 million this builds; use fewer microbatches (the bubble fraction of a larger m "
         "follows from the closed forms)"),
    ],
)  # fmt: skip
def test_zero_bubble_errors_are_one_line(capsys, argv, message):
    code, out, err = run_main(capsys, "schedule", *argv)
    assert code == 2 and out == ""
    assert err == message + "\n"


def write_trace(path: Path) -> None:
    events = [
        {"name": "0F0", "ph": "X", "ts": 1000.0, "dur": 500.0, "pid": 0, "tid": 0,
         "args": {"chunk": 0, "microbatch": 0, "kind": "F"}},
        {"name": "0SEND_F0", "ph": "X", "ts": 1500.0, "dur": 100.0, "pid": 0, "tid": 0,
         "args": {"chunk": 0, "microbatch": 0, "kind": "SEND_F"}},
        {"name": "1F0", "ph": "X", "ts": 1600.0, "dur": 500.0, "pid": 1, "tid": 0,
         "args": {"chunk": 1, "microbatch": 0, "kind": "F"}},
        {"name": "1I0", "ph": "X", "ts": 2100.0, "dur": 400.0, "pid": 1, "tid": 0,
         "args": {"chunk": 1, "microbatch": 0, "kind": "I"}},
        {"name": "1W0", "ph": "X", "ts": 2500.0, "dur": 400.0, "pid": 1, "tid": 0,
         "args": {"chunk": 1, "microbatch": 0, "kind": "W"}},
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))


def test_trace_command(capsys, tmp_path):
    trace, png = tmp_path / "trace.json", tmp_path / "trace.png"
    write_trace(trace)
    code, out, err = run_main(capsys, "trace", str(trace), "--png", str(png))
    assert code == 0 and err == ""
    assert out == f"{png}: 5 actions on 2 ranks over 1.9 ms\n"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_trace_command_errors(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"events": []}')
    code, out, err = run_main(capsys, "trace", str(bad), "--png", str(tmp_path / "x.png"))
    assert code == 2 and out == ""
    assert err == 'autopart trace: error: a trace is a JSON object with a "traceEvents" list\n'
    code, _, err = run_main(capsys, "trace", str(tmp_path / "missing.json"), "--png", str(tmp_path / "x.png"))
    assert code == 2 and err.startswith("autopart trace: error: cannot read trace ")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", "--pp", "2"])
    assert exit_info.value.code == 2
    assert "--microbatches" in capsys.readouterr().err


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_python_dash_m():
    done = run(sys.executable, "-m", "autopart", "schedule", "--pp", "2", "--microbatches", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ranks"][0] == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1".split()


def test_the_command_exits_without_teardown_but_flushed_and_with_exit_handlers():
    """exit_now (the end of every `autopart` command): output written without a newline, the
    atexit handlers' output and the exit code all reach the caller."""
    code = ("import atexit; from autopart.cli import exit_now; "
            "atexit.register(lambda: print(' bye')); print('out', end=''); exit_now(3)")
    done = run(sys.executable, "-c", code)
    assert (done.returncode, done.stdout) == (3, "out bye\n"), done.stderr


def test_python_dash_m_error_has_no_traceback():
    done = run(sys.executable, "-m", "autopart", "schedule", "--pp", "3", "--microbatches", "4", "--virtual-stages", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "autopart schedule: error: interleaved-1f1b needs microbatches divisible by pp=3 "
        "(it runs them in groups of pp), got 4; nearest valid: 3 or 6"
    ]


def test_console_script():
    script = shutil.which("autopart", path=str(Path(sys.executable).parent))
    if script is None:      # a checkout run without `pip install`; CI installs, so it must be there
        assert not os.environ.get("CI"), "CI installed autopart, but no `autopart` script beside python"
        pytest.skip("the autopart console script is not installed next to this interpreter")
    done = run(script, "schedule", "--pp", "2", "--microbatches", "4")
    assert done.returncode == 0, done.stderr
    assert "bubble          0.25 = (makespan - ideal) / ideal" in done.stdout


def test_docstring_examples():
    import doctest

    import autopart.cli

    assert doctest.testmod(autopart.cli, optionflags=doctest.ELLIPSIS).failed == 0
