"""nnetc benchmarks (issue 7): compile time, forward throughput, roofline, memory and
PyTorch comparisons against Kaldi's figures in ../shared/kaldi-ref/models/*/kaldi_stats.json.

``python -m bench [SUITE...]`` runs suites (see bench/suites.py) and prints a table
plus JSON; ``nnetc bench forward MODEL --chunk C --batch B --json`` is the stable
single measurement (bench/forward.py).  Results and their analysis: bench/RESULTS.md.
"""
