"""The lossless audit: planted bugs, the statistics, and the toy and model audits."""
