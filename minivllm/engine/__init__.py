"""The serving engine: sequences, the block manager, the scheduler and the model runner."""
