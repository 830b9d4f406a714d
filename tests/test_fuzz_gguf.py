"""The GGUF reader under fuzzing: a deterministic sample of tools/fuzz_gguf.py's cases (the long run,
`tools/fuzz_gguf.py --cases 100000`, is the tool's job) in a subprocess whose address space is capped, and
truncation of a real model's header at its structural boundaries."""
import json
import os
import subprocess
import struct
import sys
from pathlib import Path

import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.errors import GGUFError

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import fuzz_gguf_cases as cases  # noqa: E402

SAMPLE_CASES = 1500        # ~5 s; every seed file and mutation kind shows up many times
SAMPLE_MEM_LIMIT_MB = 512  # address space beyond start-up: a length field trusted for an allocation fails fast
# The sample exercises the error paths broadly: measured 49 kinds of GGUFError message on seed 0.
MIN_ERROR_KINDS = 30


@pytest.fixture(scope="module")
def sample_report(smollm2_path, gemma_path):
    env = {**os.environ, "EDGELLM_MODELS": str(Path(smollm2_path).parent)}
    out = subprocess.run([sys.executable, str(TOOLS / "fuzz_gguf.py"), "--cases", str(SAMPLE_CASES), "--seed", "0",
                          "--mem-limit-mb", str(SAMPLE_MEM_LIMIT_MB), "--json"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.returncode


def test_fuzz_sample_has_no_crash_and_no_hang(sample_report):
    report, returncode = sample_report
    assert report["crashes"] == 0, report["crash_examples"]
    assert report["hangs"] == 0, report["hang_examples"]
    assert returncode == 0
    assert report["cases"] == SAMPLE_CASES


def test_fuzz_sample_reaches_both_outcomes_from_every_seed(sample_report):
    report, _ = sample_report
    assert report["outcomes"]["ok"] > 0 and report["outcomes"]["gguf_error"] > 0
    assert {"SmolLM2-135M-Instruct-condensed", "gemma-3-270m-q4_k_m-condensed", "synthetic",
            "small-valid"} <= set(report["by_seed"])
    for name in ("SmolLM2-135M-Instruct-condensed", "gemma-3-270m-q4_k_m-condensed", "synthetic"):
        assert report["by_seed"][name].get("ok", 0) > 0, name   # mutated files that still parse get checked too
    assert report["distinct_error_kinds"] >= MIN_ERROR_KINDS


def test_cases_replay_identically():
    seeds = [cases.Seed("small-valid", cases.small_valid_file())]
    assert [cases.make_case(i, 7, seeds) for i in range(50)] == [cases.make_case(i, 7, seeds) for i in range(50)]


@pytest.fixture(scope="module")
def condensed_smollm2(smollm2_path):
    with open(smollm2_path, "rb") as f:
        import mmap
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return cases.condense(m)


def test_condensed_header_parses_like_the_real_file(tmp_path, condensed_smollm2, smollm2_path):
    header, data_size = condensed_smollm2
    path = cases.write_case(str(tmp_path), header, data_size)
    with gguf_reader.open(path) as small, gguf_reader.open(smollm2_path) as real:
        assert small.tensors.keys() == real.tensors.keys()
        assert all(small.tensors[n].shape == t.shape and small.tensors[n].nbytes == t.nbytes
                   for n, t in real.tensors.items())
        assert len(small.metadata["tokenizer.ggml.tokens"]) == cases.KEEP


def test_truncation_at_structural_boundaries_is_a_gguf_error(tmp_path, condensed_smollm2):
    """Every field boundary of the metadata, of the first and last tensor infos, and a sample of the rest (the
    fuzz tool's truncations cover them all), then the header alone with its tensor data cut off."""
    header, data_size = condensed_smollm2
    seed = cases.Seed("smollm2", header, data_size)
    n_tensors = len(seed.tensor_fields)
    cuts = {f.offset for f in seed.fields
            if (f.tensor < 0 and f.kind not in ("text", "length")) or 0 <= f.tensor < 8 or f.tensor >= n_tensors - 4}
    cuts |= {f.offset + f.size for f in seed.fields if f.tensor < 0 and f.kind not in ("text", "length")}
    cuts |= set(seed.boundaries[::40])
    assert len(cuts) > 300
    for cut in sorted(c for c in cuts if c < len(header)):
        path = cases.write_case(str(tmp_path), header[:cut], 0)
        with pytest.raises(GGUFError):
            gguf_reader.open(path)
    with pytest.raises(GGUFError, match="absurd|past the end"):
        gguf_reader.open(cases.write_case(str(tmp_path), header, 0))
    with pytest.raises(GGUFError, match="past the end"):
        gguf_reader.open(cases.write_case(str(tmp_path), header, data_size - 1))


ADDRESS_SPACE_PROBE = r"""
import resource, sys
import edgellm.engine.gguf as gguf_reader
from edgellm.errors import GGUFError
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
_, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[2]) + int(sys.argv[3]), hard))
try:
    gguf_reader.open(sys.argv[1])
except GGUFError as e:
    print("GGUFError:", e)
"""
CLAIMED_ARRAY_FILE_MB = 256
# Address space beyond the file's own map: far below the 16 bytes per claimed element (~512 MiB) that a reader
# trusting the count reserves
PROBE_HEADROOM_MB = 96


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_string_array_count_the_file_could_hold_reserves_nothing_up_front(tmp_path):
    """Regression (found by the long fuzz run): a corrupt count of up to size/8 elements made the reader allocate
    16 bytes per claimed element before walking them; with a capped address space that was MemoryError."""
    size = CLAIMED_ARRAY_FILE_MB << 20
    count = (size - 4096) // 8
    entry = (cases._str("tokenizer.ggml.tokens") + struct.pack("<IIQ", cases.ARRAY, cases.STRING, count)
             + cases._str("a") + cases._str("b") + struct.pack("<Q", 2**62))   # element 2 lies
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry
    path = cases.write_case(str(tmp_path), header, size - len(header))   # the rest: a sparse zero region
    out = subprocess.run([sys.executable, "-c", ADDRESS_SPACE_PROBE, path, str(size), str(PROBE_HEADROOM_MB << 20)],
                         capture_output=True, text=True, timeout=120)
    assert "GGUFError:" in out.stdout and "string 2 of array 'tokenizer.ggml.tokens'" in out.stdout, out.stderr[-2000:]
