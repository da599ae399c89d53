"""The machine: processes and collectives, ddp / fsdp engines, memory budgets, what the hardware computes fast."""
