"""``ninfer bench``: synthetic workloads through the public Engine (:mod:`.workload`), the device's
physical limits measured in the same run (:mod:`.limits`), and the FLOP/byte accounting and report
that turn timings into ratios to those limits (:mod:`.report`)."""
