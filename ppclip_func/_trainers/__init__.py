"""What the trainer integrations share: their options, checked where they are given."""
