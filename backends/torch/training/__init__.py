"""Training: the loop, its step, config, data, optimizers, validation, logs, checkpoints, memory."""
