"""Random decode rows for the decode-buffer and staging tests: token ids, cached-token counts and block tables."""
import numpy as np


def random_decode_rows(rng: np.random.Generator, n: int, width: int, block_size: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids int64 `[n]`, cached tokens int32 `[n]`, block tables int32 `[n, width]`) of `n` sequences whose
    next token fits their `width` blocks of `block_size`; distinct blocks per sequence, unused entries 0."""
    hist = rng.integers(0, width * block_size - 1, n).astype(np.int32)
    tables = np.zeros((n, width), np.int32)
    for i in range(n):
        used = (int(hist[i]) + block_size) // block_size
        tables[i, :used] = rng.choice(np.arange(1, 200), used, replace=False)
    return rng.integers(0, 1000, n).astype(np.int64), hist, tables
