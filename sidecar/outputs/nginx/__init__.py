"""nginx: upstream include files, nginx -t and graceful reloads."""
