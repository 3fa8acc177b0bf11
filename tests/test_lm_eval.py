"""lm-evaluation-harness against `quantkit serve` (`local-completions`: echo + logprobs log-likelihoods) on a
task file with local data, against lm-eval running the same checkpoint through HF transformers."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SERVER_KEY

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Russia", "Moscow"), ("Canada", "Ottawa"), ("Greece", "Athens"), ("Norway", "Oslo"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Cuba", "Havana"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("China", "Beijing")]

TASK = """task: capitals_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def write_task(folder) -> None:
    rows = []
    for i, (country, capital) in enumerate(CAPITALS):
        others = [CAPITALS[(i + k) % len(CAPITALS)][1] for k in (3, 7, 11)]
        choices = sorted([capital, *others])
        rows.append({"country": country, "choices": choices, "answer": choices.index(capital)})
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "capitals.yaml").write_text(TASK.format(data=data))


def test_lm_eval_local_completions_matches_hf(smollm2_server, smollm2_w4, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    write_task(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))
    served = LocalCompletionsAPI(base_url=smollm2_server.base + "/v1/completions", model="smollm2-w4", tokenizer=str(smollm2_w4),
                                 tokenizer_backend="huggingface", num_concurrent=4, max_retries=1,
                                 header={"Authorization": f"Bearer {SERVER_KEY}"})
    ours = lm_eval.simple_evaluate(model=served, tasks=["capitals_local"], task_manager=tasks, log_samples=True)
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={smollm2_w4},dtype=float32,device=cpu", tasks=["capitals_local"],
                                 task_manager=tasks, log_samples=True, batch_size=8)
    acc = {name: r["results"]["capitals_local"]["acc,none"] for name, r in (("served", ours), ("hf", hf))}
    assert acc["hf"] > 0.5  # the task is answerable: a broken scorer would sit near 0.25
    assert abs(acc["served"] - acc["hf"]) <= 1 / len(CAPITALS), acc  # at most one question flips
    served_ll = [float(resp[0][0]) for s in ours["samples"]["capitals_local"] for resp in s["resps"]]
    hf_ll = [float(resp[0][0]) for s in hf["samples"]["capitals_local"] for resp in s["resps"]]
    assert len(served_ll) == len(hf_ll) == 4 * len(CAPITALS)
    assert max(abs(a - b) for a, b in zip(served_ll, hf_ll)) == pytest.approx(0, abs=0.15), (served_ll, hf_ll)
