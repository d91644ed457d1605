"""A multi-host job's coordination and sizing: the scheduler that hands out shard and worker
slots under leases and moves the generation on when a member is lost (``scheduler``, its rules
pure in ``lease``, its Prometheus metrics in ``metrics``), and the capacity arithmetic that
sizes a job before it runs (``plan``, with the measured rates in ``plan_rates.json``).
"""
