"""kernels package of the recurrent-transformer pretraining system."""
