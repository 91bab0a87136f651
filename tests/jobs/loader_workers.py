"""A single-process training loop fed by a torch DataLoader whose workers read small files.

    python loader_workers.py DATA_DIR WORKERS EPOCHS

Each item: ``os.stat`` then open and read one file of DATA_DIR (what a dataset of images
or shards does per sample), in the DataLoader's worker processes (WORKERS > 0) or in the
main process (WORKERS = 0). The step is a tiny matmul, so the loop waits on its input.
Prints ``files N bytes B`` (what the dataset read, the truth the test checks against).
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import distdiag


class Files(Dataset):
    def __init__(self, root: str) -> None:
        self.paths = sorted(os.path.join(root, n) for n in os.listdir(root))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        p = self.paths[i]
        os.stat(p)
        with open(p, "rb") as f:
            data = f.read()
        return torch.tensor(len(data), dtype=torch.float32)


def main() -> None:
    root, workers, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ds = Files(root)
    loader = DataLoader(ds, batch_size=4, num_workers=workers, persistent_workers=workers > 0)
    w = torch.randn(64, 64)
    for _ in range(epochs):
        for batch in loader:
            (w @ w).sum().item()
            distdiag.step(samples=len(batch))
    total = sum(os.path.getsize(p) for p in ds.paths)
    print(f"files {len(ds) * epochs} bytes {total * epochs}", flush=True)


if __name__ == "__main__":
    main()
