"""kvstore.torch in one process (a ``local`` store): every API call, its errors, and
DistributedOptimizer equal to the plain optimizer however the gradients are bucketed.
The distributed behaviour (W workers against one process) is in test_torch_dist.py."""

import subprocess
import sys
import warnings

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
import kvstore.torch as hvd  # noqa: E402
from kvstore.launch.child import worker_ranks  # noqa: E402
from kvstore.launch.hostfile import Host  # noqa: E402
from kvstore.launch.spec import JobSpec  # noqa: E402

from .cluster import ROOT  # noqa: E402


@pytest.fixture(autouse=True)
def local():
    hvd.init("local")
    yield
    hvd.shutdown()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 3)
        )
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient

    def forward(self, x):
        return self.body(x)


def model(seed=0):
    torch.manual_seed(seed)
    return Net()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(n)
    ]


def loss_of(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


# ---------------------------------------------------------------- import, init, identity


def test_import_without_torch_names_the_extra():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None; import kvstore.torch"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "kvstore.torch needs PyTorch" in done.stderr
    assert "pip install 'kvstore-ps[torch]'" in done.stderr


def test_calls_before_init_say_so():
    hvd.shutdown()
    assert not hvd.is_initialized()
    for call in (
        hvd.rank,
        hvd.size,
        hvd.local_rank,
        hvd.local_size,
        hvd.join,
        lambda: hvd.allreduce(torch.ones(2)),
        lambda: hvd.allgather(torch.ones(2)),
        lambda: hvd.broadcast_parameters({"w": torch.ones(2)}),
        lambda: hvd.broadcast_object(1),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1)),
    ):
        with pytest.raises(ValueError, match="has not been initialized; use hvd.init"):
            call()


def test_identity_and_repeated_init():
    hvd.init()  # a second call does nothing
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.join() == 0
    for flag in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled, hvd.nccl_built):
        assert flag() is False
    assert hvd.ddl_built() is False and hvd.ccl_built() is False
    assert not hvd.mpi_threads_supported()
    assert hvd.cuda_built() is (kvstore.arrays.cupy is not None)  # no ROCm CuPy here
    assert hvd.rocm_built() is False


def test_init_refuses_a_store_that_does_not_sum():
    hvd.shutdown()
    with pytest.raises(ValueError, match="needs a store that sums.*'dist_async'"):
        hvd.init(kvstore.KVStore("dist_async"))
    hvd.init(kvstore.create("device"))
    assert hvd.size() == 1


@pytest.mark.parametrize("name", ["local_allreduce_cpu", "NCCL", "local_update_cpu"])
def test_init_takes_mxnet_names_of_summing_stores(name):
    # kv.type is the name given; kvstore.ALIASES says which store it is
    hvd.shutdown()
    kv = kvstore.create(name)
    assert kv.type == name.lower()
    hvd.init(kv)
    assert hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum).tolist() == [1, 1]
    hvd.shutdown()
    for given in ("dist", "dist_sync_device"):  # the dist names, without a cluster
        store = kvstore.KVStore("dist_sync")
        store._type = given
        hvd.init(store)
        hvd.shutdown()
    store = kvstore.KVStore("dist_async")
    store._type = "dist_async_device"
    with pytest.raises(ValueError, match="needs a store that sums.*'dist_async_device'"):
        hvd.init(store)
    hvd.init()


def test_shutdown_then_init_again():
    hvd.allreduce(torch.ones(3), name="x")
    hvd.shutdown()
    hvd.shutdown()  # twice is fine
    hvd.init("local")
    assert hvd.allreduce(torch.ones(3), name="x").tolist() == [1, 1, 1]


# ---------------------------------------------------------------- collectives


def test_allreduce_forms():
    t = torch.tensor([1.0, 2.0])
    out = hvd.allreduce(t)
    assert out.tolist() == [1, 2] and out is not t and out.dtype == torch.float32
    assert hvd.allreduce(t, op=hvd.Sum, name="s").tolist() == [1, 2]
    assert hvd.allreduce(t, average=False).tolist() == [1, 2]
    assert hvd.allreduce(t, prescale_factor=2, postscale_factor=3).tolist() == [6, 12]
    half = hvd.allreduce(t.double(), compression=hvd.Compression.fp16)
    assert half.dtype == torch.float64 and half.tolist() == [1, 2]
    assert hvd.allreduce(torch.tensor(5)).item() == 5  # 0-d, int
    assert hvd.allreduce(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert hvd.allreduce(torch.empty(0, 3)).shape == (0, 3)
    x = torch.tensor([4.0])
    assert hvd.allreduce_(x, op=hvd.Sum) is x and x.item() == 4


def test_allreduce_errors():
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(TypeError, match="op=Adasum needs floating-point tensors, got torch.int64"):
        hvd.allreduce(torch.ones(1, dtype=torch.int64), op=hvd.Adasum)
    with pytest.raises(ValueError, match="expected hvd.Average, Sum, Min, Max, Product or Adasum"):
        hvd.allreduce(torch.ones(1), op="Median")
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        hvd.allreduce([1.0])
    with pytest.raises(TypeError, match="bool tensors"):
        hvd.allreduce(torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="sparse tensors"):
        hvd.allreduce(torch.ones(2).to_sparse())
    with pytest.raises(TypeError, match="process_set must be a hvd.ProcessSet, got object"):
        hvd.allreduce(torch.ones(1), process_set=object())


def test_allgather_and_broadcast():
    assert hvd.allgather(torch.tensor(3)).tolist() == [3]
    m = torch.arange(6).reshape(3, 2)
    assert torch.equal(hvd.allgather(m, name="m"), m)
    flags = torch.tensor([True, False])
    assert torch.equal(hvd.allgather(flags), flags)
    with pytest.raises(ValueError, match="at most 6 dimensions"):
        hvd.allgather(torch.ones([1] * 7))
    b = torch.tensor([1.5, -0.0])
    assert torch.equal(hvd.broadcast(b, 0), b)
    assert torch.equal(hvd.broadcast(flags, root_rank=0), flags)
    y = torch.zeros(2)
    hvd.broadcast_(y, 0)
    assert y.tolist() == [0, 0]
    for bad in (1, -1, "0", True):
        with pytest.raises(ValueError, match=r"root_rank must be a rank in 0\.\.0"):
            hvd.broadcast(b, bad)


def test_broadcast_object():
    obj = {"epoch": 3, "names": ["a", "b"], "t": torch.ones(2)}
    assert hvd.broadcast_object(obj, root_rank=0) is obj  # the root keeps its own
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_object(obj, root_rank=1)


def test_broadcast_parameters_forms():
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_parameters(m.named_parameters())  # a generator; callable again
    hvd.broadcast_parameters(list(m.parameters()))
    hvd.broadcast_parameters([])
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="invalid params of type Tensor"):
        hvd.broadcast_parameters(torch.ones(2))
    with pytest.raises(ValueError, match="invalid params of type int"):
        hvd.broadcast_parameters(3)
    with pytest.raises(TypeError, match="w is a str, not a tensor"):
        hvd.broadcast_parameters({"w": "nope"})
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_parameters(m.state_dict(), root_rank=2)


def test_broadcast_optimizer_state():
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # empty state: nothing changes
    assert not opt.state
    for x, y in batches(2):
        opt.zero_grad()
        loss_of(m, x, y).backward()
        opt.step()
    saved = opt.state_dict()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer, got dict"):
        hvd.broadcast_optimizer_state({}, root_rank=0)


def test_min_max_product_and_scaling():
    t = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        assert torch.equal(hvd.allreduce(t, op=op, name="m"), t)
    ints = torch.tensor([3, -4], dtype=torch.int16)
    out = hvd.allreduce(ints, op=hvd.Product)
    assert out.dtype == torch.int16 and out.tolist() == [3, -4]
    assert hvd.allreduce(t, op=hvd.Max, prescale_factor=2).tolist() == [[2, -4], [6, 8]]


def test_adasum_of_four_workers():
    """Horovod's Adasum: equal gradients give the gradient; orthogonal ones, their sum; a
    zero one leaves the other as it is."""
    from kvstore.torch import _adasum

    g = np.array([3.0, -1.0, 2.0], np.float32)
    np.testing.assert_allclose(_adasum(np.stack([g] * 4)), g, rtol=1e-6)
    eye = np.eye(4, dtype=np.float64)
    np.testing.assert_allclose(_adasum(eye * [1, 2, 3, 4]), [1, 2, 3, 4])
    zero = np.zeros(3, np.float32)
    np.testing.assert_allclose(_adasum(np.stack([g, zero])), g)


def test_adasum_needs_a_power_of_2_workers(monkeypatch):
    monkeypatch.setattr(hvd, "size", lambda: 3)
    with pytest.raises(NotImplementedError, match="power-of-2 number of workers .*, not 3"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)


def test_async_forms_and_handles():
    x = torch.tensor([1.0, 2.0])
    h = hvd.allreduce_async(x, name="a")
    assert isinstance(h, int)
    out = hvd.synchronize(h)
    assert out.tolist() == [1, 2] and out is not x
    with pytest.raises(ValueError, match="not the handle of an operation in flight"):
        hvd.synchronize(h)
    with pytest.raises(ValueError, match="not the handle"):
        hvd.poll(12345)
    y = torch.tensor([3.0])
    h = hvd.allreduce_async_(y, op=hvd.Sum, postscale_factor=2)
    assert hvd.synchronize(h) is y and y.item() == 6
    h = hvd.allgather_async(torch.ones(2, 3))
    while not hvd.poll(h):
        pass
    assert hvd.synchronize(h).shape == (2, 3)
    assert hvd.synchronize(hvd.broadcast_async(torch.ones(2), 0)).tolist() == [1, 1]
    z = torch.zeros(2)
    assert hvd.synchronize(hvd.broadcast_async_(z, root_rank=0)) is z
    assert hvd.allreduce_(torch.tensor([4.0]), None, "p", hvd.Sum).item() == 4  # Horovod's order
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_async(z, 1)


def test_grouped_ops():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([[5]])
    ra, rb = hvd.grouped_allreduce([a, b], op=hvd.Sum, compression=hvd.Compression.fp16)
    assert ra.dtype == torch.float32 and ra.tolist() == [1, 2] and rb.tolist() == [[5]]
    assert hvd.grouped_allreduce([]) == []
    assert hvd.synchronize(hvd.grouped_allreduce_async([a, a]))[1].tolist() == [1, 2]
    c = torch.ones(3)
    assert hvd.grouped_allreduce_([c, a], op=hvd.Max)[0] is c
    h = hvd.grouped_allreduce_async_([c], postscale_factor=3)
    assert hvd.synchronize(h)[0] is c and c.tolist() == [3, 3, 3]
    ga, gb = hvd.grouped_allgather([a, b])
    assert torch.equal(ga, a) and torch.equal(gb, b)
    ra, rb = hvd.grouped_reducescatter([a, torch.ones(3, 2)], op=hvd.Sum)
    assert torch.equal(ra, a) and rb.shape == (3, 2)
    with pytest.raises(TypeError, match="expected a list of tensors, got Tensor"):
        hvd.grouped_allreduce(a)


def test_reducescatter_alltoall_allgather_object():
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(hvd.reducescatter(t, op=hvd.Sum), t)
    assert torch.equal(hvd.reducescatter(t), t)
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="expected hvd.Average or hvd.Sum"):
        hvd.reducescatter(t, op=hvd.Max)
    assert torch.equal(hvd.alltoall(t), t)  # no splits: the tensor alone
    out, received = hvd.alltoall(t, splits=[2])
    assert torch.equal(out, t[:2]) and received.dtype == torch.int32 and received.tolist() == [2]
    out, received = hvd.alltoall(t, splits=torch.tensor([0]))
    assert out.shape == (0, 2) and received.tolist() == [0]
    with pytest.raises(ValueError, match="splits must be 1 non-negative ints"):
        hvd.alltoall(t, splits=[1, 1])
    with pytest.raises(ValueError, match="add up to 4, more than the tensor's first dimension"):
        hvd.alltoall(t, splits=[4])
    out, received = hvd.synchronize(hvd.alltoall_async(t))  # always both, as Horovod
    assert torch.equal(out, t) and received.tolist() == [3]
    assert torch.equal(hvd.synchronize(hvd.reducescatter_async(t, op=hvd.Sum)), t)
    [rs] = hvd.synchronize(hvd.grouped_reducescatter_async([t], postscale_factor=2))
    assert torch.equal(rs, 2 * t)
    [ga] = hvd.synchronize(hvd.grouped_allgather_async([t]))
    assert torch.equal(ga, t)
    obj = {"a": [1, 2], "t": torch.ones(1)}
    [back] = hvd.allgather_object(obj)
    assert back["a"] == [1, 2] and torch.equal(back["t"], obj["t"])


def test_horovod_exceptions():
    """Horovod's exception names: a collective's failure (a lost peer too) is a
    HorovodInternalError, a RuntimeError; a mismatch between workers is one as well as a
    ValueError (the dist tests see it raised)."""
    from kvstore.errors import KVStoreError, PeerLostError

    assert "HorovodInternalError" in hvd.__all__ and "HostsUpdatedInterrupt" in hvd.__all__
    assert hvd.HorovodInternalError is KVStoreError
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(PeerLostError, hvd.HorovodInternalError)
    assert issubclass(hvd.MismatchError, hvd.HorovodInternalError)
    assert issubclass(hvd.MismatchError, ValueError)
    interrupt = hvd.HostsUpdatedInterrupt(skip_sync=True)
    assert isinstance(interrupt, RuntimeError) and interrupt.skip_sync is True
    with pytest.raises(hvd.HorovodInternalError, match="boom"):
        raise hvd.HorovodInternalError("boom")


def sparse(shape, entries, dense_dims=()):
    """A COO tensor of ``shape`` (sparse dims) x ``dense_dims`` with ``entries`` [(index,
    value)], duplicates kept (uncoalesced)."""
    indices = torch.tensor([i for i, _ in entries], dtype=torch.int64).reshape(-1, len(shape))
    values = torch.tensor([v for _, v in entries], dtype=torch.float32)
    values = values.reshape(-1, *([1] * len(dense_dims))).expand(-1, *dense_dims).clone()
    return torch.sparse_coo_tensor(
        indices.t(), values, (*shape, *dense_dims), check_invariants=True
    )


def test_sparse_allreduce_async_equals_its_input_in_one_process():
    """One worker: the result holds the input's entries (as Horovod's: not coalesced)."""
    grad = sparse((6,), [((4,), 1.5), ((1,), -2.0), ((4,), 0.25)], dense_dims=(3,))
    handle = hvd.sparse_allreduce_async(grad, "emb", hvd.Average)
    assert callable(handle)
    out = handle()
    assert out.is_sparse and out.shape == (6, 3) and out.dtype == torch.float32
    assert out._nnz() == 3  # the duplicate index kept
    assert torch.equal(out.to_dense(), grad.to_dense())
    summed = hvd.sparse_allreduce_async(grad.coalesce(), "emb", hvd.Sum)()
    assert torch.equal(summed.to_dense(), grad.to_dense())
    empty = hvd.sparse_allreduce_async(sparse((5, 2), []), "empty", hvd.Average)()
    assert empty._nnz() == 0 and empty.shape == (5, 2)
    ints = torch.tensor([[0, 7], [0, 0]]).to_sparse()
    assert hvd.sparse_allreduce_async(ints, "ints", hvd.Average)().to_dense().tolist() == [
        [0, 7],
        [0, 0],
    ]
    with pytest.raises(TypeError, match="expected a sparse COO tensor .*, got torch.strided"):
        hvd.sparse_allreduce_async(torch.ones(2), "d", hvd.Sum)
    with pytest.raises(ValueError, match="op='Max'; expected hvd.Average or hvd.Sum"):
        hvd.sparse_allreduce_async(grad, "m", hvd.Max)
    with pytest.raises(ValueError, match="sparse_allreduce_async's handle is a function: call"):
        hvd.synchronize(handle)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    rows=st.integers(1, 6),
    entries=st.lists(st.tuples(st.integers(0, 5), st.floats(-4, 4, width=32)), max_size=8),
    dim=st.sampled_from([(), (2,)]),
    op=st.sampled_from(["Average", "Sum"]),
)
def test_sparse_allreduce_async_against_dense(rows, entries, dim, op):
    """Any COO tensor (duplicates, none, hybrid): the result's dense form is the input's."""
    entries = [((i % rows,), v) for i, v in entries]
    grad = sparse((rows,), entries, dense_dims=dim)
    out = hvd.sparse_allreduce_async(grad, "h", getattr(hvd, op))()
    assert out.shape == grad.shape and out._nnz() == len(entries)
    assert torch.equal(out.to_dense(), grad.to_dense())


def test_process_sets():
    assert hvd.global_process_set.ranks == [0] and hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.size() == 1 and hvd.global_process_set.rank() == 0
    assert hvd.global_process_set.included()
    assert hvd.allreduce(torch.ones(1), process_set=hvd.global_process_set).item() == 1
    hvd.barrier(process_set=hvd.global_process_set)
    subset = hvd.ProcessSet([0])
    assert subset.size() is None and subset.rank() is None
    assert subset.included() and "ranks=[0]" in str(subset)
    # one worker: the only set is the global one (process sets across workers:
    # test_torch_dist.py)
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(subset)
    with pytest.raises(ValueError, match=r"distinct ranks in 0\.\.0, got \[1\]"):
        hvd.add_process_set([1])
    with pytest.raises(ValueError, match="has not been registered"):
        hvd.allgather(torch.ones(1), process_set=subset)
    assert hvd.remove_process_set(subset) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(ValueError, match="list of ranks"):
        hvd.ProcessSet("01")


def test_differentiable_collectives_in_one_process():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, name="g") * torch.tensor([3.0, 4.0])).sum().backward()
    assert x.grad.tolist() == [3, 4]
    x.grad = None
    (hvd.allgather(x) ** 2).sum().backward()
    assert x.grad.tolist() == [2, 4]
    x.grad = None
    hvd.broadcast(x, 0).sum().backward()
    assert x.grad.tolist() == [1, 1]
    x.grad = None
    a, b = hvd.grouped_allreduce([x, x * 2])
    (a + b).sum().backward()
    assert x.grad.tolist() == [3, 3]
    x.grad = None
    out, _ = hvd.alltoall(x.view(2, 1), splits=[2])
    (out * 5).sum().backward()
    assert x.grad.tolist() == [5, 5]
    x.grad = None
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    assert x.grad.tolist() == [1, 1]


def test_sync_batch_norm_in_one_process_equals_batch_norm():
    torch.manual_seed(3)
    for momentum, shape in ((0.1, (6, 3, 4, 4)), (None, (5, 3))):
        sync, plain = hvd.SyncBatchNorm(3, momentum=momentum), torch.nn.BatchNorm2d(3)
        if len(shape) == 2:
            plain = torch.nn.BatchNorm1d(3)
        plain.momentum = momentum
        with torch.no_grad():
            for m in (sync, plain):
                m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
                m.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
        for _ in range(2):
            x = torch.randn(*shape, dtype=torch.float64).float().requires_grad_()
            x2 = x.detach().clone().requires_grad_()
            g = torch.randn(*shape)
            y, y2 = sync(x), plain(x2)
            np.testing.assert_allclose(y.detach(), y2.detach(), rtol=1e-5, atol=1e-6)
            (y * g).sum().backward()
            (y2 * g).sum().backward()
            np.testing.assert_allclose(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
            for name in ("weight", "bias"):
                np.testing.assert_allclose(
                    getattr(sync, name).grad, getattr(plain, name).grad, rtol=1e-5, atol=1e-5
                )
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            np.testing.assert_allclose(getattr(sync, name), getattr(plain, name), rtol=1e-5)
        sync.eval(), plain.eval()
        x = torch.randn(*shape)
        np.testing.assert_allclose(sync(x).detach(), plain(x).detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        hvd.SyncBatchNorm(2)(torch.ones(1, 2))
    with pytest.raises(ValueError, match="at least 2D input"):
        hvd.SyncBatchNorm(2)(torch.ones(2))


def test_timeline_start_and_stop(tmp_path):
    from kvstore import timeline

    path = str(tmp_path / "trace.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="traced")
    hvd.start_timeline(path)  # again: the first is closed, a new one begins
    hvd.allgather(torch.ones(1), name="second")
    hvd.stop_timeline()
    hvd.stop_timeline()  # twice is fine
    hvd.allreduce(torch.ones(2), name="after")
    events = timeline.read_events(path + ".worker0")
    spans = [(e["name"], e["args"].get("name")) for e in events if e["ph"] == "X"]
    assert spans == [("allgather", "second")]
    assert timeline.merge(path) == (2, 1)
    with pytest.raises(ValueError, match="expected a file path"):
        hvd.start_timeline("")


# ---------------------------------------------------------------- DistributedOptimizer


def train(opt_name, steps, passes=1, distributed=None, clip=None):
    """Train ``model()``; with ``distributed`` (DistributedOptimizer's keyword arguments)
    through it, else with the plain optimizer. Returns the final state_dict."""
    m = model()
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    }[opt_name]
    opt = make(m.parameters())
    if distributed is not None:
        opt = hvd.DistributedOptimizer(
            opt,
            named_parameters=m.named_parameters(),
            backward_passes_per_step=passes,
            **distributed,
        )
    data = batches(steps * passes, seed=7)
    for s in range(steps):
        opt.zero_grad()
        for x, y in data[s * passes : (s + 1) * passes]:
            loss_of(m, x, y).backward()
        if clip is not None:
            if distributed is not None:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if distributed is not None:
                with opt.skip_synchronize():
                    opt.step()
                continue
        opt.step()
    return m.state_dict()


def used(state):
    """The parameters with gradients: as in Horovod, an unused one gets a zero gradient
    (so weight decay moves it), where a plain optimizer skips it."""
    return [k for k in state if not k.startswith("unused.")]


@pytest.mark.parametrize(
    "opt_name,passes,kwargs,clip",
    [
        ("sgd", 1, {}, None),
        ("sgd", 1, {"bucket_cap_mb": 1e-4}, None),  # one parameter (or so) per bucket
        ("adam", 2, {"bucket_cap_mb": 4e-4}, None),
        ("sgd", 3, {"gradient_predivide_factor": 4.0}, None),
        ("sgd", 1, {"bucket_cap_mb": 1e-4}, 0.5),  # synchronize, clip, skip_synchronize
    ],
)
def test_distributed_optimizer_equals_plain_optimizer(opt_name, passes, kwargs, clip):
    plain = train(opt_name, 4, passes, clip=clip)
    dist = train(opt_name, 4, passes, kwargs, clip=clip)
    for k in used(plain):
        np.testing.assert_allclose(dist[k], plain[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_fp16_compression_within_tolerance():
    plain = train("sgd", 4)
    dist = train("sgd", 4, distributed={"compression": hvd.Compression.fp16})
    for k in used(plain):  # float16 keeps ~3 digits of each gradient
        np.testing.assert_allclose(dist[k], plain[k], rtol=2e-3, atol=2e-4, err_msg=k)
    assert any(not torch.equal(dist[k], plain[k]) for k in plain)  # it did round


def test_is_a_real_optimizer():
    m = model()
    base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
    assert type(opt).__name__ == "SGD"
    assert opt.param_groups is base.param_groups and opt.state is base.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(2):
        opt.zero_grad()
        loss_of(m, x, y).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert len(opt.state) == 6  # momentum for every parameter, the unused one's too
    assert torch.equal(m.unused.weight.grad, torch.zeros(2, 2))  # unused: zero gradient
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
    hooked = []
    opt.register_step_pre_hook(lambda *a: hooked.append(1))
    opt.zero_grad()
    loss_of(m, *batches(1)[0]).backward()
    opt.step()
    assert hooked == [1]  # the optimizer's step hooks run once


def test_without_named_parameters_and_with_sum():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Sum)
    loss_of(m, *batches(1)[0]).backward()
    opt.step()


def test_backward_twice_needs_backward_passes_per_step():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = batches(1)[0]
    loss_of(m, x, y).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        loss_of(m, x, y).backward()
    del opt  # an optimizer no longer referenced leaves backward alone
    loss_of(m, x, y).backward()


def test_zero_grad_between_backward_and_step_is_refused():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    opt.zero_grad()  # before backward: fine
    loss_of(m, *batches(1)[0]).backward()
    with pytest.raises(AssertionError, match="zero_grad\\(\\) was called after loss.backward"):
        opt.zero_grad()
    opt.synchronize()
    opt.zero_grad()  # after synchronize: fine


def test_step_after_synchronize_warns():
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    loss_of(m, *batches(1)[0]).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    loss_of(m, *batches(1)[0]).backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


def test_sparse_gradients():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="call hvd.row_sparse.*or pass sparse_as_dense=True"):
        emb(torch.tensor([1, 2])).sum().backward()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), sparse_as_dense=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert emb.weight.grad.layout == torch.strided


def test_distributed_optimizer_errors():
    m = model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    named = list(m.named_parameters())
    cases = [
        ({"optimizer": "sgd"}, TypeError, "expected a torch.optim.Optimizer, got str"),
        ({"op": hvd.Min}, NotImplementedError, "Average or Sum"),
        (
            {"op": hvd.Sum, "gradient_predivide_factor": 2.0},
            ValueError,
            "gradient_predivide_factor not supported with op != Average",
        ),
        ({"gradient_predivide_factor": 0.0}, ValueError, "must be > 0"),
        ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be"),
        ({"backward_passes_per_step": 1.5}, ValueError, "backward_passes_per_step must be"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0"),
        ({"compression": "fp16"}, TypeError, "compression: expected hvd.Compression"),
        ({"process_set": 1}, TypeError, "process_set must be a hvd.ProcessSet"),
        ({"named_parameters": [("a", p) for _, p in named]}, ValueError, "Found duplicates: a"),
        ({"named_parameters": named[:2]}, ValueError, "were not named"),
        ({"named_parameters": [p for _, p in named]}, ValueError, "sequence of tuples"),
    ]
    for kwargs, error, text in cases:
        kwargs = {"optimizer": sgd, **kwargs}
        with pytest.raises(error, match=text):
            hvd.DistributedOptimizer(**kwargs)
    opt = hvd.DistributedOptimizer(sgd)
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedOptimizer(opt)
    ada = hvd.DistributedOptimizer(sgd, op=hvd.Adasum)  # one worker: a power of 2
    with pytest.raises(AssertionError, match="not supported when using Adasum"):
        ada.skip_synchronize()
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedOptimizer(ada)


# ---------------------------------------------------------------- the launcher's names


def test_launcher_exports_torchrun_names():
    spec = JobSpec(3, 1, ["python"], "127.0.0.1", 9000)
    assert spec.role_env("worker", 2)["LOCAL_RANK"] == "2"
    assert {k: spec.role_env("worker", 1)[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_SIZE")} == {
        "RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_SIZE": "3",
    }
    assert "RANK" not in spec.role_env("server", 0)
    # processes round-robin over two hosts: server 0 on a, workers 0, 1, 2 on b, a, b
    spec.hosts = [Host("a"), Host("b")]
    got = [
        (spec.worker_ranks(r)["LOCAL_RANK"], spec.worker_ranks(r)["LOCAL_SIZE"]) for r in range(3)
    ]
    assert got == [("0", "2"), ("0", "1"), ("1", "2")]


def test_child_task_exports_torchrun_names():
    one_host = {
        "DMLC_NUM_WORKER": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    }
    assert worker_ranks(one_host, 1) == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_SIZE": "2",
    }
    two_hosts = {**one_host, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert worker_ranks(two_hosts, 1) == {"RANK": "1", "WORLD_SIZE": "2"}
    assert worker_ranks({"DMLC_NUM_WORKER": "4", "SLURM_NNODES": "1"}, 3)["LOCAL_RANK"] == "3"


@pytest.mark.parametrize("case", ["a linear layer", "not marked", "marked after"])
def test_row_sparse_misuse_says_what_to_do(case):
    """A user trial's mistakes: hvd.row_sparse on a module that makes no row-sparse gradient
    (it was taken, then failed at the first step naming only a shape); a sparse gradient with
    no hvd.row_sparse, or with it called after DistributedOptimizer (both said only
    "pass sparse_as_dense=True", the whole table every step)."""
    emb = torch.nn.EmbeddingBag(10, 4, sparse=True)
    if case == "a linear layer":
        with pytest.raises(TypeError, match="expected an nn.Embedding or nn.EmbeddingBag made"):
            hvd.row_sparse(torch.nn.Linear(3, 2))
        return
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters()
    )
    if case == "marked after":
        hvd.row_sparse(emb)
    want = "called on it after DistributedOptimizer" if case == "marked after" else "call hvd.row"
    with pytest.raises(ValueError, match=want):  # (at backward(): its hooks send)
        emb(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
