-- PostgreSQL cannot drop an enum value; `cancelled` stays (unused).
SELECT 1;
