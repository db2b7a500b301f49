"""What a verl trainer run's folder says, below the checks that judge it: the config verl resolved
(verl_config) and the observer's readings as the harness's typed records (readings)."""
