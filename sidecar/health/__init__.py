"""The health control loop: the Triton client, probe rounds, one supervisor per model (a reconcile loop,
the only writer of the model's state, told about everything else as events), the healer it calls, the
discovery of models (roster) that starts and stops supervisors, every long-lived task supervised
(tasks), and live reload of config and golden files. It never imports the serving core.
"""
