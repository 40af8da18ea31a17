"""ipukit.DataLoader against PopTorch 3.4: batch samplers, rebatching, len(), batch_size=None.

PopTorch's DataLoader combines ``deviceIterations × replicationFactor × gradientAccumulation``
batches of a ``batch_sampler`` into one; ``AsyncRebatched`` cuts every sample the workers load
into combined batches as one stream; ``batch_size=None`` passes the dataset's items through.
"""
import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training

Mode = ipukit.DataLoaderMode


def _numbers(n):
    return torch.utils.data.TensorDataset(torch.arange(n))


class Stream(torch.utils.data.IterableDataset):
    """0..n-1, one sample per item; each torch worker yields its own share (i ≡ worker id)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            yield torch.tensor([i])


class Unsized(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6).unsqueeze(1))


def _values(batches):
    return [b.flatten().tolist() if isinstance(b, torch.Tensor) else b[0].flatten().tolist()
            for b in batches]


# -- batch_sampler ------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_batch_sampler_batches_are_combined_per_call(drop_last, num_workers):
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(100)),
                                            batch_size=3, drop_last=drop_last)
    loader = ipukit.DataLoader(ipukit.Options().deviceIterations(2), _numbers(100),
                               batch_sampler=sampler, drop_last=drop_last,
                               num_workers=num_workers)
    assert loader.combinedBatchSize == 6  # the sampler's batch_size × deviceIterations
    batches = _values(loader)
    if drop_last:  # 33 sampler batches: 16 whole calls, the 33rd batch alone is dropped
        assert batches == [list(range(6 * i, 6 * i + 6)) for i in range(16)]
    else:  # 34 sampler batches (the last holds 99 alone): 17 calls, the last of 4 samples
        assert batches == [list(range(6 * i, 6 * i + 6)) for i in range(16)] + [[96, 97, 98, 99]]
    assert len(loader) == len(batches)


def test_batch_sampler_order_is_the_samplers_and_all_batching_options_count():
    order = [[5, 1], [7, 3], [0, 2], [9, 8], [4, 6], [11, 10], [13, 12], [15, 14]]
    opts = ipukit.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(2)  # 8 sampler batches per call
    loader = ipukit.DataLoader(opts, _numbers(16), batch_sampler=order)
    assert loader.combinedBatchSize is None  # a plain list has no batch_size (PopTorch: None)
    assert _values(loader) == [sum(order, [])]
    two = ipukit.DataLoader(ipukit.Options().deviceIterations(2), _numbers(16),
                            batch_sampler=order, mode=Mode.Async)
    assert _values(two) == [order[i] + order[i + 1] for i in range(0, 8, 2)]
    assert len(two) == 4


def test_a_batch_sampler_with_an_incomplete_last_call_warns_like_poptorch():
    sampler = torch.utils.data.BatchSampler(range(10), batch_size=2, drop_last=False)
    with pytest.warns(UserWarning, match="yields 5 batches, not a multiple of the 2"):
        loader = ipukit.DataLoader(ipukit.Options().deviceIterations(2), _numbers(10),
                                   batch_sampler=sampler, drop_last=False)
    assert _values(loader)[-1] == [8, 9]


def test_training_fed_by_a_batch_sampler_equals_a_plain_loop():
    torch.manual_seed(3)
    model = StackNet(4, ipus=[0, 0, 1, 1])
    ref = clone_model(model)
    x, y = make_data(24)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(7)).tolist()
    sampler = torch.utils.data.BatchSampler(perm, batch_size=2, drop_last=True)
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    loader = ipukit.DataLoader(opts, torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    tm = ipukit.trainingModel(model, opts,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    calls = 0
    for xb, yb in loader:
        assert xb.shape[0] == 12
        tm(xb, yb)
        calls += 1
    assert calls == len(loader) == 2
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for c in range(2):
        idx = perm[12 * c:12 * (c + 1)]
        reference_training(ref, ref_opt, x[idx], y[idx], device_iterations=2,
                           gradient_accumulation=3, replicas=1)
    assert max_weight_diff(model, ref) < 1e-5
    assert max_weight_diff(model, StackNet(4, ipus=[0, 0, 1, 1])) > 1e-3


# -- AsyncRebatched ---------------------------------------------------------------------------
@pytest.mark.parametrize("worker_size", [None, 3, 20])
def test_async_rebatched_iterable_with_drop_last_delivers_the_sync_loaders_samples(worker_size):
    opts = ipukit.Options().deviceIterations(2)
    sync = ipukit.DataLoader(opts, Stream(90), batch_size=10)
    rebatched = ipukit.DataLoader(opts, Stream(90), batch_size=10, mode=Mode.AsyncRebatched,
                                  rebatched_worker_size=worker_size)
    expected = [list(range(20 * i, 20 * i + 20)) for i in range(4)]  # 90 // 20 calls
    assert _values(sync) == _values(rebatched) == expected
    assert len(sync) == len(rebatched) == 4


@pytest.mark.filterwarnings("ignore:ipukit.DataLoader. 90 samples and drop_last=False")
@pytest.mark.parametrize("drop_last", [True, False])
def test_async_rebatched_keeps_every_workers_leftover_samples(drop_last):
    # 2 workers, 50 samples each, combined batch 20: PopTorch rebatches the workers' batches
    # (20, 20, 10 each) as one stream, so no worker's last 10 samples are lost.
    opts = ipukit.Options().deviceIterations(2)
    loader = ipukit.DataLoader(opts, Stream(90 if not drop_last else 100), batch_size=10,
                               num_workers=2, drop_last=drop_last, mode=Mode.AsyncRebatched,
                               rebatched_worker_size=5)
    batches = _values(loader)
    if drop_last:
        assert sorted(sum(batches, [])) == list(range(100))
        assert [len(b) for b in batches] == [20] * 5
    else:  # 90 samples: 4 calls and the stream's tail of 10
        assert sorted(sum(batches, [])) == list(range(90))
        assert [len(b) for b in batches] == [20] * 4 + [10]
    assert len(loader) == len(batches)


@pytest.mark.filterwarnings("ignore:ipukit.DataLoader. 90 samples and drop_last=False")
def test_async_with_drop_last_false_rebatches_like_poptorch():
    opts = ipukit.Options().deviceIterations(2)
    loader = ipukit.DataLoader(opts, Stream(90), batch_size=10, num_workers=2, drop_last=False,
                               mode=Mode.Async)
    batches = _values(loader)
    assert [len(b) for b in batches] == [20] * 4 + [10]  # one incomplete batch, not one per worker
    assert sorted(sum(batches, [])) == list(range(90))


def test_rebatching_keeps_the_batch_structure():
    data = torch.utils.data.TensorDataset(torch.arange(12).float().unsqueeze(1), torch.arange(12))
    loader = ipukit.DataLoader(ipukit.Options().deviceIterations(4), data, batch_size=1,
                               mode=Mode.AsyncRebatched, rebatched_worker_size=3)
    (x0, y0), (x1, y1), (x2, y2) = list(loader)
    assert torch.equal(x1, torch.arange(4, 8).float().unsqueeze(1))
    assert torch.equal(y2, torch.arange(8, 12))


def test_the_accessors_rebatched_size_cuts_the_stream():
    with pytest.warns(UserWarning, match="the last batch will hold 1 samples"):
        loader = ipukit.DataLoader(ipukit.Options(), _numbers(10), batch_size=3, drop_last=False)
    acc = ipukit.AsynchronousDataAccessor(loader, rebatched_size=4)
    assert _values(acc) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # PopTorch drops the tail of 2
    acc.terminate()


# -- len() --------------------------------------------------------------------------------------
LEN_CASES = {
    "map": lambda d: ipukit.DataLoader(_opts(), _numbers(50), batch_size=3, drop_last=d),
    "map-async": lambda d: ipukit.DataLoader(_opts(), _numbers(50), batch_size=3, drop_last=d,
                                             mode=Mode.Async),
    "map-rebatched": lambda d: ipukit.DataLoader(_opts(), _numbers(50), batch_size=3,
                                                 drop_last=d, mode=Mode.AsyncRebatched,
                                                 rebatched_worker_size=4),
    "map-sampler": lambda d: ipukit.DataLoader(
        _opts(), _numbers(50), batch_size=3, drop_last=d,
        sampler=torch.utils.data.SubsetRandomSampler(range(0, 50, 2))),
    "iterable": lambda d: ipukit.DataLoader(_opts(), Stream(50), batch_size=3, drop_last=d),
    "iterable-rebatched": lambda d: ipukit.DataLoader(_opts(), Stream(50), batch_size=3,
                                                      drop_last=d, mode=Mode.AsyncRebatched,
                                                      rebatched_worker_size=5),
    "batch-sampler": lambda d: ipukit.DataLoader(
        _opts(), _numbers(50), drop_last=d,
        batch_sampler=torch.utils.data.BatchSampler(range(50), batch_size=3, drop_last=False)),
}


def _opts():
    return ipukit.Options().deviceIterations(2)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("case", list(LEN_CASES))
def test_len_is_the_number_of_batches_iterated(case, drop_last):
    loader = LEN_CASES[case](drop_last)
    batches = list(loader)
    assert len(loader) == len(batches)
    samples = sum(len(b[0]) if isinstance(b, list) else len(b) for b in batches)
    kept = 25 if case == "map-sampler" else 50
    assert samples == (kept // 6 * 6 if drop_last else kept)


def test_len_of_an_unsized_dataset_is_an_ipukit_type_error():
    loader = ipukit.DataLoader(ipukit.Options(), Unsized(), batch_size=2)
    with pytest.raises(ipukit.Error, match="has no __len__") as info:
        len(loader)
    assert isinstance(info.value, TypeError)
    assert len(list(loader)) == 3  # list() still works: Python treats the TypeError as no hint


# -- batch_size=None ------------------------------------------------------------------------
class Batches(torch.utils.data.Dataset):
    """Each item is already one whole call's batch (4 samples of width 8)."""

    def __init__(self):
        self.x = make_data(12)[0].reshape(3, 4, 8)

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return self.x[i]


def test_batch_size_none_passes_whole_batches_through():
    opts = ipukit.Options().deviceIterations(2)
    ds = Batches()
    loader = ipukit.DataLoader(opts, ds, batch_size=None, drop_last=False)
    assert loader.combinedBatchSize is None
    items = list(loader)
    assert len(loader) == len(items) == 3
    assert all(torch.equal(a, ds[i]) for i, a in enumerate(items))
    net = torch.nn.Linear(8, 3)
    model = ipukit.inferenceModel(net, opts)
    for x in loader:
        torch.testing.assert_close(model(x), net(x))


def test_batch_size_none_with_drop_last_is_refused_as_torch_does():
    opts = ipukit.Options()
    with pytest.raises(ipukit.Error, match="^batch_size=None option disables auto-batching.*"
                                           "drop_last=False"):
        ipukit.DataLoader(opts, Batches(), batch_size=None)
    opts.deviceIterations(2)  # a refused loader leaves the options unfrozen


# -- refusals -----------------------------------------------------------------------------------
def _bs(n=3):
    return torch.utils.data.BatchSampler(range(12), batch_size=n, drop_last=True)


BAD = [
    (dict(batch_sampler=_bs(), batch_size=4),
     r"^`batch_sampler` option is mutually exclusive with batch_size, shuffle\..*batch_size=4"),
    (dict(batch_sampler=_bs(), shuffle=True),
     r"^`batch_sampler` option is mutually exclusive with batch_size, shuffle\..*shuffle=True"),
    (dict(batch_sampler=_bs(), batch_size=None), r"^`batch_sampler` option is mutually"),
    (dict(batch_sampler=_bs(), sampler=range(12)),
     r"^batch_sampler option is mutually exclusive with batch_size, shuffle, sampler.*sampler="),
    (dict(batch_sampler=5), r"batch_sampler=5\): expected a torch.utils.data.BatchSampler"),
    (dict(batch_sampler=_bs(), mode=Mode.AsyncRebatched, rebatched_worker_size=2),
     r"rebatched_worker_size=2, batch_sampler=...\): the batch sampler sets"),
    (dict(batch_size=0), r"batch_size=0\): expected an int >= 1"),
    (dict(batch_size="4"), r"batch_size='4'\): expected an int >= 1"),
    (dict(batch_size=True), r"batch_size=True\): expected an int >= 1"),
    (dict(batch_size=2, mode=Mode.AsyncRebatched, rebatched_worker_size=50),
     r"^The rebatched_worker_size \(50\) must be <= to the combined batch size \(4\)\. Pass "),
    (dict(batch_size=2, mode=Mode.AsyncRebatched, rebatched_worker_size=0),
     r"rebatched_worker_size=0\): expected an int >= 1"),
    (dict(batch_size=2, mode=Mode.AsyncRebatched, async_options={"rebatched_size": 4}),
     r"^You cannot use DataLoaderMode.AsyncRebatched and manually specify the rebatched_size"),
    (dict(mode=Mode.Async, async_options={"bogus": 1}), r"unknown option\(s\) \['bogus'\]"),
    (dict(mode=Mode.Async, async_options={"buffer_size": 0}), r"'buffer_size': 0.*int >= 1"),
    (dict(mode=Mode.Async, async_options=[1]), r"async_options=\[1\]\): expected a dict"),
    (dict(num_workers=-1), r"^num_workers option should be non-negative.*num_workers=-1"),
    (dict(shuffle=True, sampler=range(12)), r"^sampler option is mutually exclusive with shuffle"),
    (dict(persistent_workers=True), r"^persistent_workers option needs num_workers > 0"),
    (dict(mode="fast"), r"mode='fast'"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_argument_is_an_ipukit_error_naming_it_and_the_fix(kwargs, match):
    opts = ipukit.Options().deviceIterations(2)
    with pytest.raises(ipukit.Error, match=match) as info:
        ipukit.DataLoader(opts, _numbers(12), **kwargs)
    assert isinstance(info.value, ValueError)
    opts.deviceIterations(1)  # not frozen by the refused loader


def test_an_iterable_dataset_refuses_shuffle_as_torch_does():
    with pytest.raises(ipukit.Error, match="expected unspecified shuffle option"):
        ipukit.DataLoader(ipukit.Options(), Stream(4), shuffle=True)


def test_the_accessor_refuses_an_async_loader_and_a_rebatched_size_of_one():
    loader = ipukit.DataLoader(ipukit.Options(), _numbers(4), mode=Mode.Async)
    with pytest.raises(ipukit.Error, match="^The DataLoader already uses an "
                                           "AsynchronousDataAccessor internally"):
        ipukit.AsynchronousDataAccessor(loader)
    sync = ipukit.DataLoader(ipukit.Options(), _numbers(4))
    with pytest.raises(ipukit.Error, match="^rebatched_size must be None or greater than 1"):
        ipukit.AsynchronousDataAccessor(sync, rebatched_size=1)
    with pytest.raises(ipukit.Error, match="buffer_size=0"):
        ipukit.AsynchronousDataAccessor(sync, buffer_size=0)


def test_rebatching_batches_without_one_batch_dimension_is_a_data_error():
    class Ragged(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2, 1), torch.zeros(3)

    loader = ipukit.DataLoader(ipukit.Options().deviceIterations(2), Ragged(), batch_size=None,
                               drop_last=False, mode=Mode.AsyncRebatched)
    assert [len(b[0]) for b in loader] == [2]  # batch_size=None: nothing to rebatch (PopTorch)
    loader = ipukit.DataLoader(ipukit.Options().deviceIterations(2),
                               torch.utils.data.TensorDataset(torch.zeros(4, 1)),
                               batch_size=1, mode=Mode.AsyncRebatched,
                               collate_fn=lambda items: (torch.zeros(len(items)), torch.zeros(5)))
    with pytest.raises(ipukit.core.errors.DataError, match="share one batch dimension"):
        list(loader)
