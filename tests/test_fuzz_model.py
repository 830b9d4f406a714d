"""Fuzzing past the reader: a fixed seed's sample of tools/fuzz_model.py (files the reader accepts, with wrong
config values, tensors, token tables, merges or chat templates) loaded, generated from and chatted with. Only
success or edgellm's own errors are acceptable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_model  # noqa: E402

SAMPLE_CASES = 50  # ~30 s on two loaded cores; every mutation kind shows up several times


def test_fuzz_model_sample_gives_only_success_or_edgellm_errors():
    report = fuzz_model.run(SAMPLE_CASES, seed=0)
    assert report["others"] == [], report["others"]
    assert report["outcomes"].get("ok", 0) > 0 and report["outcomes"].get("edgellm_error", 0) > 0
    assert len(report["kinds"]) == 10
