"""`quantkit eval` end to end: the tiny model for the machinery, SmolLM2 for the verdicts."""

import json

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from quantkit.eval.tool_use import parse_calls


run = run_cli


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [{"f": {"a": 1}}]),
    ('<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>', [{"f": {"a": 1}}, {"g": {}}]),
    ('{"name": "f", "arguments": "{\\"a\\": 2}"}', [{"f": {"a": 2}}]),
    ('[get_weather(city="Paris"), set_timer(minutes=5)]', [{"get_weather": {"city": "Paris"}}, {"set_timer": {"minutes": 5}}]),
    ("The capital of Canada is Ottawa.", []),
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None),
])
def test_parse_calls(text, calls):
    assert parse_calls(text) == calls


def test_eval_runs_offline_and_keeps_every_item(tiny_dir, tmp_path, capsys):
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    code, stdout, err = run(capsys, "eval", str(tmp_path / "q"), "--lengths", "128", "--limit", "2",
                            "--out", str(tmp_path / "ev"), "--json")
    assert code == 0, err
    summary = {r["task"]: r for r in json.loads(stdout)["summary"]}
    assert set(summary) == {"ppl", "kl", "retrieval", "tool-use"}
    assert all(r["verdict"] for r in summary.values())
    results = json.loads((tmp_path / "ev/results.json").read_text())
    retrieval = [i for i in results["items"] if i["task"] == "retrieval"]
    assert len(retrieval) == 9 * 2 and all("output" in i["baseline"] and "correct" in i["quantized"] for i in retrieval)
    assert (tmp_path / "ev/report.md").read_text().startswith("# quantkit eval")


def test_eval_errors_are_one_line(tiny_dir, tmp_path, capsys):
    code, _, err = run(capsys, "eval", str(tiny_dir), "--out", str(tmp_path / "ev"))
    assert code == 2 and "no quantkit.json" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "eval", str(tiny_dir), "--baseline", str(tiny_dir), "--tasks", "vibes")
    assert code == 2 and "unknown task 'vibes'" in err


@pytest.mark.integration
def test_verdicts_on_smollm2(smollm2_dir, tmp_path, capsys):
    """8-bit equivalent on KL (and far below 4-bit's KL); a checkpoint with scales x3 is degraded."""
    for bits in (4, 8):
        code, _, err = run(capsys, "quantize", "smollm2-135m", "--bits", str(bits), "-o", str(tmp_path / f"w{bits}"), "-q")
        assert code == 0, err
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(tmp_path / "w4", broken)
    tensors = load_file(broken / "model.safetensors")
    tensors = {k: (v * 3 if k.endswith("weight_scale") else v) for k, v in tensors.items()}
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    kl = {}
    for name in ("w8", "w4", "broken"):
        code, stdout, err = run(capsys, "eval", str(tmp_path / name), "--tasks", "ppl,kl", "--limit", "6",
                                "--out", str(tmp_path / f"ev-{name}"), "--json")
        assert code == 0, err
        kl[name] = {r["task"]: r for r in json.loads(stdout)["summary"]}["kl"]
    print({k: (round(v["quantized"], 4), v["verdict"]) for k, v in kl.items()})
    assert kl["w8"]["verdict"] == "equivalent" and kl["w8"]["quantized"] < kl["w4"]["quantized"] / 10
    assert kl["broken"]["verdict"] == "degraded"
