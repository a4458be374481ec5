"""The embedding worker: consumer → batcher → encoder → sink → ack."""
