"""What a trained run produces for users: exported models, classification maps, predictions."""
