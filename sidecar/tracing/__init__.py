"""Distributed tracing: the sidecar's spans over OTLP (docs/tracing.md).

`spans.py` says what the health loop and the serving core may ask of a tracer, and answers it with
nothing while tracing is off; `otel.py` answers it with the OpenTelemetry SDK, imported only when
`tracing.endpoint` is set (the app factory builds it, owns it and shuts it down).
"""
