"""Pure tensors and dataclasses: sampling, the lossless rule, planning and statistics; no models, no I/O."""
