"""The fleet: where pods come from (discovery), whether they answer (health), what each
serves (the registry), how busy each is (load, scraped metrics), and the embedded
simulated fleet of `kvroute serve`."""
