"""`rlgateway launch SPEC --ray ADDRESS`: the whole topology (engine servers, gateway replicas on
one PostgreSQL, the trainer) on a Ray cluster, supervised (`ray_launcher.py`)."""
