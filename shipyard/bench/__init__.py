"""The benchmarks, run as `shipyard bench NAME` (or `python -m shipyard.bench.NAME`): each module prints readable
tables, then its figures as one JSON object on the last line (`_common.finish`).

They ship inside the package so that an ordinary (non-editable) install runs them from any directory. They sit at the
top of the import order, beside the command line: a benchmark may import anything in shipyard, and nothing in the
library imports a benchmark. This file imports nothing, so listing the benchmarks costs no torch.
"""
