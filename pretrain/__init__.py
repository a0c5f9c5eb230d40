"""pretrain package of the recurrent-transformer pretraining system."""
