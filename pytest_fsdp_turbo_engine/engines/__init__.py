"""The engines a rank trains with: our FSDP2 and FSDP-Turbo engines, the adapter that runs verl's
engines as they are, the protocol every engine meets and the registry that finds one by name."""
