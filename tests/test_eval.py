"""`quantkit eval` end to end: the tiny model for the machinery, SmolLM2 for the verdicts."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from quantkit.eval.tool_use import parse_calls
from tests.conftest import run_cli

run = run_cli


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [{"f": {"a": 1}}]),
    ('<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>', [{"f": {"a": 1}}, {"g": {}}]),
    ('{"name": "f", "arguments": "{\\"a\\": 2}"}', [{"f": {"a": 2}}]),
    ('[get_weather(city="Paris"), set_timer(minutes=5)]', [{"get_weather": {"city": "Paris"}}, {"set_timer": {"minutes": 5}}]),
    ("The capital of Canada is Ottawa.", []),
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None),
    ('Sure:\n```json\n{"name": "search_flights", "arguments": {"from": "Boston", "to": "Denver"}}\n```\nDone.',
     [{"search_flights": {"from": "Boston", "to": "Denver"}}]),
    ('```\n[get_weather(city="Paris")]\n```', [{"get_weather": {"city": "Paris"}}]),
    ('```json\n{"name": "f", "arguments": {"a": \n```', None),
    ("Use this:\n```python\nimport requests\nprint(requests.get(url))\n```", []),
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
    for png in ("retrieval.png", "kl.png"):
        assert (tmp_path / "ev" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_errors_are_one_line(tiny_dir, tmp_path, capsys):
    code, _, err = run(capsys, "eval", str(tiny_dir), "--out", str(tmp_path / "ev"))
    assert code == 2 and "no quantkit.json" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "eval", str(tiny_dir), "--baseline", str(tiny_dir), "--tasks", "vibes")
    assert code == 2 and "unknown task 'vibes'" in err
    for args, said in ((["--limit", "-3"], "--limit -3"), (["--lengths", "1k,0k"], "'0k' is shorter than the 128")):
        code, _, err = run(capsys, "eval", str(tiny_dir), "--baseline", str(tiny_dir), "--out", str(tmp_path / "ev"), *args)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ev").exists()
    other = tmp_path / "other"  # the same model under another vocabulary: one word renamed
    shutil.copytree(tiny_dir, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"w251"', '"v251"'))
    code, _, err = run(capsys, "eval", str(tiny_dir), "--baseline", str(other), "--tasks", "kl", "--out", str(tmp_path / "ev"))
    assert code == 2 and "different vocabularies (256 and 256 tokens)" in err and len(err.strip().splitlines()) == 1, err


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


def _summary(stdout: str) -> dict:
    return {r["task"]: r for r in json.loads(stdout)["summary"]}


def test_baseline_results_are_cached_by_content(tiny_dir, tmp_path, capsys, monkeypatch):
    """A second eval against the same baseline reuses its results (same numbers, no baseline run);
    --no-cache, or other weights at the same path, recompute."""
    import shutil

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    code, _, err = run(capsys, "quantize", str(base), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    args = ["eval", str(tmp_path / "q"), "--lengths", "128", "--limit", "2", "--json"]
    first = run(capsys, *args, "--out", str(tmp_path / "ev1"))
    second = run(capsys, *args, "--out", str(tmp_path / "ev2"))
    assert first[0] == second[0] == 0, first[2] + second[2]
    assert json.loads(first[1])["details"]["baseline_cached"] == []
    assert json.loads(second[1])["details"]["baseline_cached"] == ["retrieval", "tool use"]
    assert _summary(first[1]) == _summary(second[1])
    items = [json.loads((tmp_path / f"ev{i}/results.json").read_text())["items"] for i in (1, 2)]
    assert items[0] == items[1]
    third = run(capsys, *args, "--no-cache", "--out", str(tmp_path / "ev3"))
    assert json.loads(third[1])["details"]["baseline_cached"] == []
    assert _summary(third[1]) == _summary(first[1])
    weights = load_file(base / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, base / "model.safetensors", metadata={"format": "pt"})
    fourth = run(capsys, *args, "--out", str(tmp_path / "ev4"))
    assert fourth[0] == 0 and json.loads(fourth[1])["details"]["baseline_cached"] == []


def test_ppl_and_kl_on_a_local_text_file(tiny_dir, tmp_path, capsys):
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(f"w{(i * 7) % 250}" for i in range(3000)))
    code, stdout, err = run(capsys, "eval", str(tmp_path / "q"), "--tasks", "ppl,kl", "--text", str(text),
                            "--out", str(tmp_path / "ev"), "--json", "--no-cache")
    assert code == 0, err
    summary = _summary(stdout)
    assert summary["ppl"]["n"] == 3000 // 512  # rows of 512 tokens cut from the file
    code, _, err = run(capsys, "eval", str(tmp_path / "q"), "--tasks", "ppl", "--text", str(tmp_path / "none.txt"),
                       "--out", str(tmp_path / "ev2"))
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_bfcl_data_runs_end_to_end(tiny_dir, tmp_path, capsys):
    """--bfcl adds bfcl-eval's real items (with their possible answers) to the bundled set; --limit is per source."""
    pytest.importorskip("bfcl_eval")
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    code, stdout, err = run(capsys, "eval", str(tmp_path / "q"), "--tasks", "tool-use", "--bfcl", "simple,irrelevance",
                            "--limit", "3", "--out", str(tmp_path / "ev"), "--json")
    assert code == 0, err
    items = [i for i in json.loads((tmp_path / "ev/results.json").read_text())["items"] if i["task"] == "tool-use"]
    assert len(items) == 9
    bfcl = [i for i in items if i["id"].startswith(("simple_python_", "irrelevance_"))]
    assert [i["category"] for i in bfcl] == ["simple"] * 3 + ["irrelevance"] * 3
    assert all("calls" in i["quantized"] and "correct" in i["baseline"] for i in items)
    code, _, err = run(capsys, "eval", str(tmp_path / "q"), "--tasks", "tool-use", "--tool-file", str(tmp_path / "none.jsonl"),
                       "--out", str(tmp_path / "ev2"))
    assert code == 2 and "no tool-use file" in err and len(err.strip().splitlines()) == 1


def test_runtime_and_hf_backends_agree(tiny_dir, tmp_path, capsys):
    """The default backend (quantkit's engine, both models) and --backend hf give the same greedy outputs on the
    same retrieval and tool-use items (float32: equal to the token), and the same perplexities."""
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    summaries, items = {}, {}
    for backend in ("hf", "runtime"):
        code, stdout, err = run(capsys, "eval", str(tmp_path / "q"), "--backend", backend, "--dtype", "fp32", "--lengths", "128",
                                "--limit", "3", "--out", str(tmp_path / f"ev-{backend}"), "--json", "--no-cache")
        assert code == 0, err
        summaries[backend] = _summary(stdout)
        items[backend] = json.loads((tmp_path / f"ev-{backend}/results.json").read_text())["items"]
    assert set(summaries["runtime"]) == {"ppl", "kl", "retrieval", "tool-use"}
    for who in ("baseline", "quantized"):
        assert summaries["runtime"]["ppl"][who] == pytest.approx(summaries["hf"]["ppl"][who], rel=1e-3)
        for h, r in zip(items["hf"], items["runtime"], strict=True):
            if h["task"] == "retrieval":
                assert r[who]["output"] == h[who]["output"], h["id"]
            else:  # tool prompts + 160 tokens pass this model's 256-token context: the engine stops there, HF runs on
                assert h[who]["output"].startswith(r[who]["output"]) and len(r[who]["output"]) > 50, h["id"]
    assert json.loads((tmp_path / "ev-runtime/results.json").read_text())["config"]["backend"] == "runtime"
