"""The producer inside vLLM: the scheduler-side and worker-side adapters behind
``kv_connector.connector``, the options they read, the step planner, the delivery book,
the per-request table, the workers' report and the producer's metrics."""
