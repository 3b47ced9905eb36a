"""Task rl: GRPO on rewards a program checks (`task.RL`), with its prompts (`prompts`), rewards (`rewards`),
sampled groups of completions (`rollouts`) and policy loss (`loss`): the only task with its own data readers, which
nothing but RL uses."""
