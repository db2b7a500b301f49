"""The adapter to the Ascend fsdp_turbo library: its checkout (clone, cache, lock, verify), its
schema read from that checkout, and the exact turbo_config a rank hands it."""
