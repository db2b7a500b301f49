"""What engines, rollouts and the step share, below all of them: PPO's maths as pure tensor
functions (ppo), the batch a step trains on and the loss over it (train_batch), the few
collectives the harness runs itself (reductions), and which transformers class a checkpoint is
loaded as (hf_model)."""
