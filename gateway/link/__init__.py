"""The Redis link: connections (plain, cluster, Sentinel, the embedded server), the
listener's pipelined and cluster pipelines, durable acknowledgements, and reply errors."""
