"""Applications on the library: the command line, the demo, the benchmark, drafter evaluation, the batch job."""
