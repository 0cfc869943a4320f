"""The benchmark suite (``python -m benchmarks``) in its ``--quick`` mode: every section runs and the
table holds each of its figures with a number. Quick sizes measure nothing; pass/miss is not checked."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.__main__ import main

FIGURES = {
    "advantages": [f"advantage/{m}_{k}" for m in ("loo", "grpo", "rloo", "gigpo", "blpo") for k in ("s", "speedup")],
    "store": ["store/write_MB_s", "store/read_MB_s", "store/jsonl_vs_parquet_size", "store/one_column_read_share"],
    "rollout": [
        "rollout/batched_tokens_s",
        "rollout/vs_bare_replay",
        "rollout/vs_one_generate",
        "rollout/vs_one_at_a_time",
        "rollout/prefill_vs_new",
        "rollout/naive_prefill_vs_new",
        "rollout/decode_padding",
        "rollout/qwen3_vocab_tokens_s",
    ],
    "update": [
        "update/ppo_tokens_s",
        "update/vs_bare_loop",
        "update/dp2_tokens_s",
        "update/fsdp2_tokens_s",
        "update/padding",
        "update/pi_old_max_diff",
        *(
            f"update/{batch}_{name}"
            for batch in ("loop", "appo")
            for name in ("tokens_computed_per_unique", "packed_vs_padded", "tree_vs_padded")
        ),
    ],
    "pipeline": [
        "tracing/share_of_iteration",
        "tracing/flow_wait_share",
        "tracing/store_kb_per_iteration",
        "pipeline/flow_vs_plain",
        "pipeline/helper_cpu_s",
        "memory/peak_rss_mb",
        "memory/peak_tree_rss_mb",
        "startup/temporary_server_s",
        "startup/running_server_s",
    ],
}


def run_quick(tmp_path, capsys, sections: list[str]) -> None:
    assert main(["--quick", "--no-mlflow", "--out", str(tmp_path), "--only", *sections]) == 0
    printed = capsys.readouterr().out
    figures = {f["name"]: f for f in json.loads((tmp_path / "figures.json").read_text())["figures"]}
    expected = [name for s in sections for name in FIGURES[s]] + ["suite/seconds"]
    assert sorted(figures) == sorted(expected)
    for name in expected:
        assert math.isfinite(figures[name]["value"]), name
        assert name in printed, f"{name} missing from the printed table"
    assert (tmp_path / "figures.csv").is_file()


@pytest.mark.slow
def test_quick_suite_in_process_sections(tmp_path, capsys):
    """Everything but the pipeline section (which starts a Prefect server: see the next test). Slow: the
    update section starts torchrun ranks (ddp and fsdp), about 40 s; ``make test-fast`` leaves it out."""
    run_quick(tmp_path, capsys, ["advantages", "store", "rollout", "update"])


@pytest.mark.slow
def test_quick_suite_pipeline_section(prefect_harness, tmp_path, capsys, monkeypatch):
    """The pipeline section: one shortened train run through Prefect and MLflow on Prefect's temporary server
    (a minute or more), then the start-up against a running server: the session's, named by
    ``PREFECT_API_URL`` as a user's stack would be, instead of one started for it."""
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    run_quick(tmp_path, capsys, ["pipeline"])


def test_publish_replaces_only_the_marked_block(tmp_path):
    """`make bench` writes its table into docs/benchmarks.md between two markers: the rest of the page is kept, a
    second publish replaces the first, and a page without the markers is named before anything is written."""
    from benchmarks.report import PUBLISH_END, PUBLISH_START, Figure, publish

    page = tmp_path / "README.md"
    page.write_text(f"# Title\n\nbefore\n{PUBLISH_START}\nold table\n{PUBLISH_END}\nafter\n")
    figures = [
        Figure("update/vs_bare_loop", 0.934, "x", ">= 0.95", False, "bare: 16,307 tok/s"),
        Figure("store/read_MB_s", 279.7, "MB/s", "", None),
    ]
    publish(figures, {"quick": False}, page)
    publish(figures[:1], {"quick": False}, page)
    text = page.read_text()
    assert (
        text.startswith("# Title\n\nbefore\n") and text.endswith(f"{PUBLISH_END}\nafter\n") and "old table" not in text
    )
    assert "| `update/vs_bare_loop` | 0.934 | x | >= 0.95 | **miss** | bare: 16,307 tok/s |" in text
    assert "store/read_MB_s" not in text and "0 of 1 targets met" in text and text.count(PUBLISH_START) == 1
    bare = tmp_path / "other.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="other.md has no benchmark block"):
        publish(figures, {}, bare)
    assert bare.read_text() == "no markers\n"
