"""The decoding engine: the loop of draft, verify and accept for batches of rows, its costs, and the scheduler."""
