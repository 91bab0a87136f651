"""pytorch/examples' DDP tutorial in shape (distributed/ddp-tutorial-series/multinode.py), on gloo.

Imports, ``init_process_group``, ``load_train_objs()`` (the dataset, the model, the
optimizer), a ``DataLoader`` with a ``DistributedSampler`` and 2 workers, a
``Trainer`` that wraps the model in DDP and runs its epochs. Run it under
``torchrun`` (through ``distdiag-wrap`` for the tests).

The dataset build is the tutorial's heavy part here: ``MyTrainDataset`` preprocesses
each sample in Python (a fixed amount of work, ``--build-samples``), as a job that
tokenizes or decodes its data at start does. ``DDP_TUTORIAL_CACHED=1`` loads it
"from a cache" instead (the same tensors, made at once): the same job without the
slow build, whose wall-clock difference is what the build costs.

Rank 0 prints ``loop <s> s``: from the moment the last rank finished its imports (the
``import`` block at the top) to the last barrier (tests/truth.py reads it). The imports
are left out of it: torch's took 2-12 s here depending on the load of the shared cores,
the same in both twins on average but noisy enough to hide a 3 s build; the startup
finding keeps them too (distdiag/detectors/startup.py). ``T_IMPORTED`` is
``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process of the host).
"""

from __future__ import annotations

import time

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--samples", type=int, default=2048)
ap.add_argument("--build-samples", type=int, default=2000, help="samples preprocessed one by one at start")
ap.add_argument("--workers", type=int, default=2)
args = ap.parse_args()
T_IMPORTED = time.perf_counter()


class MyTrainDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int) -> None:
        self.size = size
        g = torch.Generator().manual_seed(0)
        if os.environ.get("DDP_TUTORIAL_CACHED") == "1":  # as torch.load of the prepared tensors would
            x, y = torch.rand(size, 20, generator=g), torch.rand(size, 1, generator=g)
            self.data = list(zip(x, y))
            return
        # preprocess sample by sample: normalize, a few feature transforms (a fixed amount of work)
        data = []
        for i in range(args.build_samples):
            x = torch.rand(20, generator=g)
            for _ in range(40):
                x = (x - x.mean()) / (x.std() + 1e-6)
                x = torch.tanh(x * 1.01)
            if i < size:
                data.append((x, torch.rand(1, generator=g)))
        while len(data) < size:
            data.append((torch.rand(20, generator=g), torch.rand(1, generator=g)))
        self.data = data

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer) -> None:  # type: ignore[type-arg]
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            for source, targets in self.train_data:
                self._run_batch(source, targets)


def load_train_objs() -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:  # type: ignore[type-arg]
    train_set = MyTrainDataset(args.samples)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    dataset, model, optimizer = load_train_objs()
    loader = DataLoader(dataset, batch_size=args.batch, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset), num_workers=args.workers)  # fmt: skip
    Trainer(model, loader, optimizer).train(args.epochs)
    dist.barrier()
    t_end = time.perf_counter()
    last_imported = torch.tensor([T_IMPORTED], dtype=torch.float64)
    dist.all_reduce(last_imported, op=dist.ReduceOp.MAX)  # after the clock stopped
    if dist.get_rank() == 0:
        print(f"loop {t_end - float(last_imported):.4f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
