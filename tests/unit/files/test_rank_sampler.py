"""The rank-kept sampler (``files.rank_sampler``): each rank's rows are fixed by the seed
and the same every epoch, the ranks' shares are disjoint and cover every row, each epoch
shuffles within a rank, every rank has as many batches as the others, and no batch
passes the token budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kv_connector.files.rank_sampler import RankKeptBatchSampler, equalize, pack, partition

MAX_LEN = 2048


def lengths_of(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, MAX_LEN + 600, n)]  # some past the budget


def samplers(lengths: list[int], replicas: int, seed: int = 7, **kw: object) -> list[RankKeptBatchSampler]:
    return [RankKeptBatchSampler(MAX_LEN, lengths, replicas, r, seed=seed, **kw) for r in range(replicas)]  # type: ignore[arg-type]


def rows_of(s: RankKeptBatchSampler, epoch: int) -> list[int]:
    s.set_epoch(epoch)
    return [int(i) for b in s for i in b]


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_each_ranks_rows_are_the_same_every_epoch_disjoint_and_covering(replicas: int) -> None:
    lengths = lengths_of(301)
    ss = samplers(lengths, replicas)
    for epoch in range(4):
        shares = [set(rows_of(s, epoch)) for s in ss]
        assert shares == [set(p.tolist()) for p in ss[0].parts], epoch  # the partition, every epoch
        assert sum(len(x) for x in shares) == len(lengths)  # disjoint
        assert set().union(*shares) == set(range(len(lengths)))  # covering
    # the partition is the seed's alone: built again (another process, another rank) it is the same
    assert [p.tolist() for p in samplers(lengths, replicas)[-1].parts] == [p.tolist() for p in ss[0].parts]
    if replicas > 1:
        other = samplers(lengths, replicas, seed=8)[0].parts
        assert [p.tolist() for p in other] != [p.tolist() for p in ss[0].parts]


def test_each_epoch_shuffles_within_the_rank() -> None:
    ss = samplers(lengths_of(200), 2)
    for s in ss:
        orders = [rows_of(s, e) for e in range(3)]
        assert orders[0] != orders[1] != orders[2] and sorted(orders[0]) == sorted(orders[2])
        s2 = samplers(lengths_of(200), 2)[s.rank]
        assert rows_of(s2, 1) == orders[1]  # an epoch's order is the seed's and epoch's


@pytest.mark.parametrize(("n", "replicas"), [(301, 2), (301, 8), (9, 4), (40, 3)])
def test_every_rank_has_as_many_batches_and_no_batch_passes_the_budget(n: int, replicas: int) -> None:
    lengths = lengths_of(n, seed=n)
    ss = samplers(lengths, replicas)
    for epoch in range(3):
        counts = set()
        for s in ss:
            s.set_epoch(epoch)
            counts.add(len(s))
            batches = list(s)
            assert len(batches) == len(s) and all(len(b) >= 1 for b in batches)
            assert all(sum(min(lengths[i], MAX_LEN) for i in b) <= MAX_LEN for b in batches)
            assert set(rows_of(s, epoch)) == set(s.parts[s.rank].tolist())  # padding never loses a row
        assert len(counts) == 1, (epoch, counts)


def test_max_batches_caps_an_epoch_and_long_rows_can_be_dropped() -> None:
    lengths = lengths_of(120)
    assert all(len(s) == 3 for s in samplers(lengths, 2, max_batches=3))
    kept = samplers(lengths, 2, truncate_long_samples=False)
    seen = set(rows_of(kept[0], 0)) | set(rows_of(kept[1], 0))
    assert seen == {i for i, n in enumerate(lengths) if n <= MAX_LEN}


def test_a_repeated_epoch_is_remembered_as_speculators_trainer_expects() -> None:
    s = samplers(lengths_of(50), 2)[1]
    first = s._generate_batches(2)
    assert s._cached_generated_batches[0] == 2 and s._generate_batches(2) is first


def test_partition_balances_tokens_and_fewer_rows_than_ranks_give_no_batches() -> None:
    lengths = np.array(lengths_of(500), dtype=np.int64)
    parts = partition(lengths, 4, seed=1)
    tokens = [int(lengths[p].sum()) for p in parts]
    assert max(tokens) - min(tokens) <= int(lengths.max())
    assert [len(p) for p in partition(lengths[:3], 4, seed=1)] == [1, 1, 1, 0]
    assert [len(s) for s in samplers(lengths_of(3), 4)] == [0, 0, 0, 0]  # as many (none) on every rank


def test_pack_and_equalize() -> None:
    lengths = np.array([5, 5, 5, 9, 1], dtype=np.int64)
    assert [b.tolist() for b in pack(np.array([0, 1, 2, 3, 4]), lengths, 10)] == [[0, 1], [2], [3, 4]]
    grown = equalize([np.array([0, 1, 2]), np.array([3])], 4)
    assert [b.tolist() for b in grown] == [[0], [1], [2], [3]]  # split, the widest first
    assert [b.tolist() for b in equalize([np.array([0, 1]), np.array([3])], 4)] == [[0], [1], [3], [0]]
    assert [b.tolist() for b in equalize([np.array([4])], 3)] == [[4], [4], [4]]  # one row: repeated


LOADER_CHECK = """
import argparse, json, sys, torch
from pathlib import Path
from datasets import Dataset
from safetensors.torch import save_file
from hs_connectors.transfer import FileTransfer, HiddenStatesBackend
import speculators.train.distributed as dist
from speculators.train.dataloader import create_train_val_loaders
import kv_connector.speculators  # registers kv-hidden-states

root = Path(sys.argv[1])
g = torch.Generator().manual_seed(0)
rows = [torch.randint(0, 1000, (int(n),), generator=g).tolist()
        for n in torch.randint(20, 300, (41,), generator=g)]
ds = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                        "seq_len": [len(r) for r in rows]})
ds.set_format(type="torch")
ds.save_to_disk(str(root / "data"))
(root / "hs").mkdir()
for i, r in enumerate(rows):
    save_file({"token_ids": torch.tensor(r), "hidden_states": torch.full((len(r), 3, 8), float(i))},
              str(root / "hs" / f"hs_{i}.safetensors"))
index = {tuple(r): i for i, r in enumerate(rows)}
backend = HiddenStatesBackend.registry["kv-hidden-states"]
parser = argparse.ArgumentParser()
backend.add_train_args(parser)
out = {}
for kind in ["rank-kept", "speculators"]:
    out[kind] = []
    for rank in range(2):
        dist._dp_size, dist._dp_rank = 2, rank  # what speculators' launcher sets on rank `rank` of 2
        backend.from_train_args(parser.parse_args(["--kv-hs-sampler", kind]), str(root / "data"))
        train, _ = create_train_val_loaders(
            data_path=str(root / "data"), total_seq_len=600, hidden_states_dtype=torch.float32,
            transfer=FileTransfer(root / "hs"), vllm_endpoint="http://unused", on_missing="raise",
            verifier_name_or_path=None, request_timeout=1.0, max_retries=0,
            generation_validation_retries=0, max_consecutive_generation_failures=1, hidden_size=8,
            num_target_layers=2, num_workers=0, prefetch_factor=2, preprocess=None,
            train_data_ratio=0.9, seed=5)
        epochs = []
        for epoch in range(3):
            train.batch_sampler.set_epoch(epoch)  # as speculators' trainer does
            seen, batches = [], 0
            for batch in train:
                batches += 1
                docs = batch["document_ids"][0]
                for d in range(int(docs.max()) + 1):
                    at = docs == d
                    i = index[tuple(batch["input_ids"][0][at].tolist())]
                    assert bool((batch["hidden_states"][0][at] == float(i)).all()), i  # the row's own states
                    seen.append(i)
            epochs.append({"rows": seen, "batches": batches})
        out[kind].append({"sampler": type(train.batch_sampler).__name__, "epochs": epochs})
print(json.dumps(out))
"""


def test_speculators_own_loader_keeps_each_ranks_rows_with_the_flag(tmp_path: Path) -> None:
    """speculators' ``create_train_val_loaders`` on two ranks, three epochs, the rows read
    from files: with ``--kv-hs-sampler rank-kept`` each rank gets the same rows every
    epoch in another order, the ranks' rows are disjoint and cover the train split, and
    both ranks have as many batches; with speculators' own sampler the ranks' rows move."""
    site = Path(os.environ.get("SPECULATORS_SITE") or Path(sys.prefix) / "speculators-site-packages")
    if not (site / "speculators").is_dir():
        pytest.skip(f"speculators is not installed in {site}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", LOADER_CHECK, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    kept, theirs = got["rank-kept"], got["speculators"]
    assert [r["sampler"] for r in kept] == ["RankKeptBatchSampler"] * 2
    assert [r["sampler"] for r in theirs] == ["MultipackDistributedBatchSamplerV2"] * 2
    train_rows = set(range(int(41 * 0.9)))
    for epoch in range(3):
        shares = [r["epochs"][epoch]["rows"] for r in kept]
        assert sorted(shares[0] + shares[1]) == sorted(train_rows), epoch  # disjoint, covering, once each
        assert kept[0]["epochs"][epoch]["batches"] == kept[1]["epochs"][epoch]["batches"]
    for r in kept:
        orders = [e["rows"] for e in r["epochs"]]
        assert set(orders[0]) == set(orders[1]) == set(orders[2]) and orders[0] != orders[1]
    moved = [set(r["epochs"][0]["rows"]) != set(r["epochs"][1]["rows"]) for r in theirs]
    assert any(moved)  # speculators' own sampler gives a rank other rows the next epoch
