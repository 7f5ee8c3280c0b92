DROP TABLE provider_slots;
DROP TABLE provider_limits;
