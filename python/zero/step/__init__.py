"""step: the optimizer update on a partition: the optimizer registry, the
host / CUDA / torch update paths, loss scaling and the thread count."""
