"""quant.threading_layer: how OpenMP's idle workers wait. On a busy machine they spin briefly, then sleep
(GOMP_SPINCOUNT); on an idle one, and whenever the user chose, nothing is set."""
import os
import subprocess
import sys
from pathlib import Path

from edgellm.quant.threading_layer import BUSY_SPIN_COUNT, busy_wait_settings

ROOT = Path(__file__).resolve().parents[1]


def test_busy_machine_gets_a_bounded_spin_and_user_choices_stand():
    assert busy_wait_settings({}, busy=True) == {"GOMP_SPINCOUNT": BUSY_SPIN_COUNT}
    assert busy_wait_settings({}, busy=False) == {}
    assert busy_wait_settings({"OMP_WAIT_POLICY": "ACTIVE"}, busy=True) == {}
    assert busy_wait_settings({"GOMP_SPINCOUNT": "50"}, busy=True) == {}
    assert "OMP_WAIT_POLICY" not in busy_wait_settings({}, busy=True)  # never sleeping at once: see the module


def _policy_at_import(load: float, **env) -> tuple:
    """(GOMP_SPINCOUNT, OMP_WAIT_POLICY) after importing quant in a fresh process whose load average reads `load`."""
    code = ("import os; os.getloadavg = lambda: (%r, 0.0, 0.0); import edgellm.quant.threading_layer; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))" % load)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return tuple(None if v == "None" else v for v in out)


def test_the_choice_is_made_at_import_from_the_load_average():
    busy = float(os.cpu_count() or 1)
    assert _policy_at_import(busy) == (BUSY_SPIN_COUNT, None)
    assert _policy_at_import(0.0) == (None, None)
    assert _policy_at_import(busy, OMP_WAIT_POLICY="PASSIVE") == (None, "PASSIVE")


def test_a_missing_openmp_runtime_warns_once_with_the_fix(tmp_path):
    """The real omp extension module, copied with its libgomp dependency renamed, so the loader cannot find it."""
    import numba.np.ufunc
    ufunc_dir = Path(numba.np.ufunc.__path__[0])
    original = next(ufunc_dir.glob("omppool*.so"))
    data = original.read_bytes()
    names = [n for n in (b"libgomp.so.1.0.0", b"libgomp.so.1") if n in data]
    assert names, "omppool does not name libgomp"
    (tmp_path / original.name).write_bytes(data.replace(names[0], b"libgomx" + names[0][len(b"libgomp"):]))
    code = ("import warnings, numba.np.ufunc as u; u.__path__.insert(0, %r); warnings.simplefilter('always'); "
            "import edgellm.quant.threading_layer as t; import edgellm.quant.linear; print('CHOSEN', t.CHOSEN)"
            % str(tmp_path))
    clean = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True,
                         check=True)
    assert run.stderr.count("SlowThreadingWarning") == 1, run.stderr
    assert "libgomx" in run.stderr and "apt install libgomp1" in run.stderr and "apk add libgomp" in run.stderr
    assert "CHOSEN omp" not in run.stdout and "CHOSEN " in run.stdout
    ok = subprocess.run([sys.executable, "-W", "always", "-c",
                         "import edgellm.quant.threading_layer as t; print(t.CHOSEN)"],
                        cwd=ROOT, env=clean, capture_output=True, text=True, check=True)
    assert ok.stdout.strip() == "omp" and "SlowThreadingWarning" not in ok.stderr
