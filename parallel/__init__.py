"""parallel package of the recurrent-transformer pretraining system."""
