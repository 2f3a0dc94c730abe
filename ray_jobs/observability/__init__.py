"""What a run lets you watch: TensorBoard event files (``tensorboard``) and the processes' CPU,
steal and peak memory (``process_stats``), and the bytes of a worker's model state (``model_memory``).
The activations autograd holds for backward are counted in ``core.activations``, beside the
checkpointing that lowers them.

Runs where it is measured: world rank 0 of the Ray Train workers writes the event files, the
pipeline's driver writes its own; every worker and stage reads its own process's statistics.
"""
