"""What ZeRO-DP partitions: parameters, gradients and optimizer states."""
