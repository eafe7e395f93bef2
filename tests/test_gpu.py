"""The device store, the optimizers and compression on CuPy arrays, against NumPy.

Skipped without CuPy and a GPU; run on a machine with one (see the README).
"""

import numpy as np
import pytest

from kvstore import create
from kvstore import optimizer as opt
from kvstore.arrays import cupy, device_id
from kvstore.compression import Compression

from .test_optimizer import CASES


def _gpus() -> int:
    if cupy is None:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() == 0, reason="needs CuPy and a CUDA GPU")]


@pytest.mark.parametrize("optimizer", [c[0] for c in CASES], ids=lambda o: o.name)
def test_optimizer_on_cupy_matches_numpy(optimizer):
    rng = np.random.default_rng(5)
    w_np = rng.standard_normal(1000).astype(np.float32)
    w_cp = cupy.asarray(w_np)
    host, device = opt.Updater(optimizer), opt.Updater(opt.from_spec(optimizer.spec()))
    for _ in range(5):
        g = rng.standard_normal(1000).astype(np.float32)
        host(0, g, w_np)
        device(0, cupy.asarray(g), w_cp)
    np.testing.assert_allclose(cupy.asnumpy(w_cp), w_np, rtol=1e-5, atol=1e-6)
    assert all(isinstance(state, cupy.ndarray) for state in device.states[0])


def test_device_store_reduces_on_the_gpu():
    kv = create("device")
    kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9))
    gpus = _gpus()
    init = cupy.ones((64, 32), cupy.float32)
    kv.init("w", init)
    rng = np.random.default_rng(6)
    grads_np = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(4)]
    grads = []
    for i, g in enumerate(grads_np):
        with cupy.cuda.Device(i % gpus):
            grads.append(cupy.asarray(g))
    outs = []
    for i in range(min(gpus, 2)):
        with cupy.cuda.Device(i):
            outs.append(cupy.empty((64, 32), cupy.float32))
    kv.pushpull("w", grads, out=outs)
    reference = create("local")
    reference.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9))
    reference.init("w", np.ones((64, 32), np.float32))
    expected = np.empty((64, 32), np.float32)
    reference.pushpull("w", grads_np, out=expected)
    for i, out in enumerate(outs):
        assert device_id(out) == i
        np.testing.assert_allclose(cupy.asnumpy(out), expected, rtol=1e-5, atol=1e-6)
    host_out = np.empty((64, 32), np.float32)
    kv.pull("w", out=host_out)
    np.testing.assert_allclose(host_out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["2bit", "1bit"])
def test_compression_on_cupy_matches_numpy(scheme):
    codec = Compression.from_params({"type": scheme})
    rng = np.random.default_rng(7)
    res_np, res_cp = {}, {}
    for _ in range(3):
        g = rng.standard_normal(1001).astype(np.float32)
        packed_np, header_np = codec.encode(res_np, 0, g)
        packed_cp, header_cp = codec.encode(res_cp, 0, cupy.asarray(g))
        assert cupy.asnumpy(packed_cp).tobytes() == packed_np.tobytes()
        np.testing.assert_allclose(header_cp, header_np, rtol=1e-5)
        np.testing.assert_allclose(cupy.asnumpy(res_cp[0]), res_np[0], rtol=1e-5, atol=1e-6)
        back = codec.decode(packed_cp, header_cp, 1001, np.float32)
        np.testing.assert_allclose(
            cupy.asnumpy(back), codec.decode(packed_np, header_np, 1001, np.float32), rtol=1e-5
        )


def test_torch_on_cuda_tensors_through_the_launcher():
    """The PyTorch API with a model on the GPU (its gradients' averages land on the GPU)."""
    import subprocess
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            str(root / "launch.py"),
            *("-n", "2", "-s", "1", "--launcher", "local"),
            sys.executable,
            str(root / "tests" / "scripts" / "torch_cuda.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("DistributedOptimizer OK") == 2, done.stdout
