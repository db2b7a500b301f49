from fsdp_turbo_standin_core import make_parallel_state

ParallelState, init_parallel_state, get_parallel_state = make_parallel_state(data_getters=True)
