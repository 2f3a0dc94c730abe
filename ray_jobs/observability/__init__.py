"""What a run lets you watch: TensorBoard event files (``tensorboard``) and the processes' CPU,
steal and peak memory (``process_stats``), the activations autograd holds for backward
(``saved_tensors``, which the bench reads), and the bytes of a worker's model state (``model_memory``).

Runs where it is measured: world rank 0 of the Ray Train workers writes the event files, the
pipeline's driver writes its own; every worker and stage reads its own process's statistics.
"""
