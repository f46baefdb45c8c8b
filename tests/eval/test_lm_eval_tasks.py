from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import torchkv

TASKS = Path(torchkv.__file__).parent / "tasks"


def test_every_offline_task_builds_prompts_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    # metadata reaches the dataset builders of torchkv/tasks/docs.py: two documents per task keeps this fast
    manager = TaskManager(include_path=str(TASKS), include_defaults=False, metadata={"count": 2})
    offline, ruler = manager.load("torchkv_offline")["tasks"], manager.load("torchkv_ruler")["tasks"]
    assert len(offline) == 2 + 5 * 2 and len(ruler) == 5 * 3
    for name, task in {**offline, **ruler}.items():
        task.build_all_requests(limit=2)
        assert len(task.instances) >= 2, name
        for instance in task.instances:
            context, second = instance.arguments[:2]
            if name.startswith("torchkv_wiki"):  # multiple choice: (context, " choice")
                assert instance.request_type == "loglikelihood" and second.startswith(" ") and second.strip()
            else:  # generation: (context + question, generation kwargs)
                assert instance.request_type == "generate_until" and "\nAnswer: The " in context[-160:]
                assert second["until"] == ["\n"]
                assert task.process_results(instance.doc, [instance.doc["target"]]) == {"recall": 1.0}
            assert len(context) > 1000, name
