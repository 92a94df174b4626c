"""Tensor parallelism: the worker processes of ranks 1..N-1 and how rank 0 (the engine process)
starts them, sends them each step's plan, and notices when one dies."""
